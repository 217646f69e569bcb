"""``RoundWatch``: a closed native round's watch, ``over`` once a member's key goes (agent/rendezvous/native.py,
**After a loss**). The handler asks it every monitor tick (``num_nodes_waiting``) and makes it again when etcd broke
its stream."""

from __future__ import annotations

import threading

from etcd3.events import DeleteEvent

from trainwarden.agent.etcd.client import ETCD_CLIENT_ERRORS
from trainwarden.agent.etcd.watch import watch_registered
from trainwarden.agent.rendezvous.native_round import Round

__all__ = ["RoundWatch"]


class RoundWatch:
    """Watches a closed round's ``nodes/``: ``over`` once a member's key goes (lost, or left to re-join)."""

    def __init__(self, client, round_: Round, nodes_prefix: str, *, replay: bool = True) -> None:
        """``replay``: from the round's close (a loss since is seen); else from now, for a round whose close etcd
        has compacted away (the caller then counts the round's keys)."""
        self.round = round_
        self.lost: str | None = None
        """The first member whose key went."""
        self.error: BaseException | None = None
        self._members = frozenset(round_.members)
        self._over = threading.Event()
        self._client = client
        since = {"start_revision": round_.as_of + 1} if replay else {}
        self._id = client.add_watch_prefix_callback(nodes_prefix, self._on_response, **since)

    def _on_response(self, response) -> None:  # the client's watch thread: no etcd calls here
        if isinstance(response, BaseException):
            self.error = response
            self._over.set()
            return
        for event in response.events:
            node = event.key.decode().rpartition("/")[2]
            if isinstance(event, DeleteEvent) and node in self._members and self.lost is None:
                self.lost = node
                self._over.set()

    @property
    def over(self) -> bool:
        return self._over.is_set()

    def alive(self) -> bool:
        """False once the client dropped the watch without a word (its stream broke; agent/etcd/watch.py)."""
        return watch_registered(self._client, self._id, self._on_response)

    def wait(self, timeout: float | None = None) -> bool:
        """True once the round is over (or the watch failed: ``error``), False after ``timeout``."""
        return self._over.wait(timeout)

    def cancel(self) -> None:
        try:
            self._client.cancel_watch(self._id)
        except ETCD_CLIENT_ERRORS:
            pass

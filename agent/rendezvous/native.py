"""An etcd-native rendezvous round: every node joins with a key of its own, one transaction closes the round.

Why: torch's dynamic rendezvous (which the ``etcd3`` torchrun backend and torch's ``c10d`` both run on) keeps a
round in one pickled blob, and every join, heartbeat and close is a compare-and-set of that blob; N nodes
joining at once retry against each other, so a round's cost grows faster than N (measured on the dev VM:
8 nodes 1.3 s, 64 nodes 8.3 s, 128 not within 9 minutes). Here no key is written by more than one node.

Keys (``agent/etcd/keys.py``: ``rendezvous_key``), under ``<prefix>/rdzv/<job>/rounds/<round>/``, the round
zero-padded so text order is round order:

* ``nodes/<node>``: the node's join, under the node's lease (the caller's: a dead node's join goes by itself).
* ``close/by``: the node that will close the round, under its lease: the first to join, or, when its lease
  ends before the round closed, the first waiting node to take it over (create-if-absent).
* ``close/members``: the closed round, written once and never changed: the sorted member ids, who closed it,
  why, and ``as_of``, the etcd revision the membership was read at.

**Join** is one transaction: if ``close/members`` is absent, put ``nodes/<node>`` and, nested, create
``close/by`` if absent (else read it); if the round is closed, read its members and go on to the next round.
**Close**: only the closer watches the round's nodes (N events); every other node watches ``close/`` alone (one
event). The closer applies ``CloseRule``: at once when ``max_nodes`` have joined; when ``min_nodes`` have and every
living member of the previous round is back (a restart after a loss); else when ``min_nodes`` have and the last call
(``last_call_s``) since that moment has passed. A previous member whose key went is back, not gone, when its key in
this round is there (read at once: the two rounds' watches may deliver in either order). During that last call the
closer asks etcd every ``LEASE_CHECK_S`` how much of each awaited member's lease is left: a member whose lease went
two keep-alive periods (a third of its TTL each) without renewal is taken for lost (powered off or cut off) without
waiting for the lease to run out (``CloseRule.presume_lost``). Never while the previous round is intact (a node that
comes after a round closed waits for the next, as with torch's wait list). The close is one transaction: if
``close/members`` is absent, put the membership and delete the previous round's keys (so a job keeps two rounds at
most: the closed one and the next) — however many nodes try, exactly one close wins, and the others read its
membership.
**Ranks**: a node's index in the membership, the same on every node (``CloseRule.members``, native_round.py).
**After a loss**: ``RoundWatch`` watches the closed round's ``nodes/`` from ``as_of``; a member's key going (its
lease expired or was revoked, or it left on purpose through ``next_round``) ends the round for everyone who watches;
each survivor calls ``next_round()``, which joins round + 1. Nodes that joined a round too late to be in it wait in
round + 1; ``waiting()`` counts them, for a caller that regroups to let them in. A node waiting there may stop
waiting once the job is over (the ``closed`` callable: ``NativeRendezvousClosed``).

Writes per round: a join per node, one close, a leave per node that left or came too late, an election per dead
closer: O(N), and no write is retried against another node's. No torch here.
"""

from __future__ import annotations

import json
import logging
import queue
import time
from typing import Any, Callable

from etcd3.events import DeleteEvent, PutEvent
from etcd3.exceptions import RevisionCompactedError
from etcd3.utils import prefix_range_end

from trainwarden.agent.etcd.client import ETCD_CLIENT_ERRORS, describe_etcd_error, with_failover
from trainwarden.agent.etcd.keys import DEFAULT_PREFIX, rendezvous_key
from trainwarden.agent.rendezvous.native_round import (CloseRule, NativeRendezvousClosed, NativeRendezvousConfig,
                                                       NativeRendezvousError, NativeRendezvousTimeout,
                                                       NativeRendezvousUnavailable, Round)
from trainwarden.agent.rendezvous.round_watch import RoundWatch

logger = logging.getLogger(__name__)

LEASE_CHECK_S = 0.5
"""How often the closer asks how much of each awaited member's lease is left (``_missed_keep_alives``)."""

__all__ = ["CloseRule", "NativeRendezvous", "NativeRendezvousClosed", "NativeRendezvousConfig", "NativeRendezvousError",
           "NativeRendezvousTimeout", "NativeRendezvousUnavailable", "Round", "RoundWatch"]

_REJOIN = object()
"""Put into a waiting round's event queue by ``lease_renewed``: join again with the new lease."""


class _TooLate(Exception):
    """This node joined a round that closed without it: on to the next."""


class NativeRendezvous:
    """One node's side of the etcd-native rendezvous of one job (see the module docstring).

    ``lease`` is the node's etcd lease (an ``etcd3`` lease or its id), kept alive by the caller: the node's
    joins go with it. ``client`` may be shared by many ``NativeRendezvous`` (the benchmark's simulated nodes)."""

    def __init__(self, client, *, job: str, node: str, lease: Any, config: NativeRendezvousConfig,
                 prefix: str = DEFAULT_PREFIX, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, closed: Callable[[], bool] | None = None,
                 on_wait: Callable[[int], None] | None = None) -> None:
        """``closed``: whether the job's rendezvous is closed (the job ended); asked at most every ``resync_s``
        while this node waits for a round, which then ends in ``NativeRendezvousClosed``. ``on_wait(round)``:
        told when this node found its round closed without it and waits in ``round`` (a spare, a late node)."""
        if not node or "/" in node:
            raise ValueError(f"node id {node!r} must be non-empty and hold no '/'")
        self._client, self.job, self.node, self._lease = client, job, node, lease
        self.config, self.prefix, self._clock, self._wall = config, prefix, clock, wall
        self.last: Round | None = None
        """The last round this node was a member of."""
        self._watch: RoundWatch | None = None
        self._wake: queue.Queue | None = None  # the events of the round this node waits in (``lease_renewed``)
        self._closing = False  # whether this node is the round's closer while it waits
        self._closed, self._closed_asked, self._on_wait = closed, clock(), on_wait

    def lease_renewed(self, lease: Any) -> None:
        """The caller's lease lapsed and it granted ``lease``: this node's joins go with it from now on, and a
        node waiting in a round joins it again at once (its key went with the old lease; without it a round that
        needs this node would wait for it until the join timeout). Safe from another thread."""
        self._lease = lease
        wake = self._wake
        if wake is not None:
            wake.put(_REJOIN)

    # -- the public surface ------------------------------------------------------------------------------

    def next_round(self) -> Round:
        """Join the next open round and return it once closed with this node in it.

        A member of a round that is not over leaves it (deletes its key) once it has joined the next one: for
        the others that ends the round, as a loss does. Joined first, so that a node waiting in the next round
        as its closer, which watches this round's keys, sees the member back before it sees it gone; left
        first, that closer took the member for gone and closed the round without it, and the two nodes
        alternated single-node rounds (issue 45, the soak). ``NativeRendezvousTimeout`` after
        ``join_timeout_s``."""
        deadline = self._clock() + self.config.join_timeout_s
        if self._watch is not None:
            self._watch.cancel()
        leaving = self.last.number if self.last is not None and (self._watch is None or not self._watch.over) \
            else None
        self._watch = None
        # a member goes on to the next round; a new node starts at the oldest round still kept (at most
        # two are: the last closed one and the next) and walks up past the closed ones
        number = self.last.number + 1 if self.last is not None else self.oldest_round()
        while True:
            try:
                return self._join_and_wait(number, deadline, leaving)
            except _TooLate:
                leaving = None  # left with the first join
                logger.info("job %s: %s joined round %d after it closed; it waits in round %d (a hot spare while "
                            "the rounds are full)", self.job, self.node, number, number + 1)
                number += 1
                if self._on_wait is not None:
                    try:
                        self._on_wait(number)
                    except Exception:  # noqa: BLE001 - a listener's error is not the rendezvous'
                        logger.exception("job %s: on_wait(%d) failed", self.job, number)
            except (NativeRendezvousTimeout, NativeRendezvousClosed):
                try:  # a node that gives up is not waited for: members would regroup to let it in
                    self._leave(number)
                except NativeRendezvousError:
                    pass
                raise

    def _join_and_wait(self, number: int, deadline: float, leaving: int | None = None) -> Round:
        """Join round ``number`` and wait for it to close with this node; ``_TooLate`` when it closed without.
        ``leaving``: the round this node is a member of, left once the join is written (``next_round``)."""
        joined = self._join(number)
        if leaving is not None:
            self._leave(leaving)
        if isinstance(joined, Round):  # closed before this join
            if self.node in joined.members:
                return self._became_member(joined)
            raise _TooLate()
        revision, closer = joined
        if closer == self.node:
            result = self._close(number, deadline)
        else:
            result = self._await_close(number, revision, deadline)
        if self.node in result.members:
            return self._became_member(result)
        self._leave(number)  # joined after the closer read the membership
        raise _TooLate()

    def leave(self) -> None:
        """Leave the last round for good (delete this node's key: for the others, the round is over)."""
        if self._watch is not None:
            self._watch.cancel()
        if self.last is not None:
            self._leave(self.last.number)

    def watch(self, round_: Round | None = None) -> RoundWatch:
        """A ``RoundWatch`` of ``round_`` (default: the last round this node was in); ``next_round`` cancels it."""
        round_ = round_ or self.last
        if round_ is None:
            raise NativeRendezvousError(f"node {self.node} has no round to watch: call next_round() first")
        prefix = self._key(round_.number, "nodes") + "/"
        try:
            watch = self._call("watch the round's nodes", lambda: RoundWatch(self._client, round_, prefix))
        except NativeRendezvousUnavailable as exc:
            if not isinstance(exc.__cause__, RevisionCompactedError):
                raise
            # etcd compacted past the round's close (auto-compaction; a round lives for days): watch from now;
            # a loss in between shows in the count of the round's keys (``present``)
            watch = self._call("watch the round's nodes", lambda: RoundWatch(self._client, round_, prefix,
                                                                             replay=False))
        if round_ is self.last:
            self._watch = watch
        return watch

    def present(self, round_: Round | None = None) -> int:
        """How many keys ``round_``'s ``nodes/`` holds (default: this node's last round): fewer than its members
        means one went. The check for a caller that cannot trust a watch alone: python3-etcd3 does not tell a
        watch's callback that its stream broke (its ``Watcher._run`` fails on a name it no longer imports)."""
        round_ = round_ or self.last
        if round_ is None:
            raise NativeRendezvousError(f"node {self.node} has no round: call next_round() first")
        response = self._call("count the round's nodes", lambda: self._client.get_prefix_response(
            self._key(round_.number, "nodes") + "/", count_only=True))
        return int(response.count)

    def waiting(self, round_: Round | None = None) -> int:
        """How many nodes have joined the round after ``round_`` (default: this node's last round)."""
        round_ = round_ or self.last
        number = round_.number + 1 if round_ is not None else self.oldest_round()
        response = self._call("count the waiting nodes", lambda: self._client.get_prefix_response(
            self._key(number, "nodes") + "/", count_only=True))
        return int(response.count)

    def oldest_round(self) -> int:
        """The lowest round number that has any key (0 for a job with none).

        The first key in key order, which etcd finds without reading the rest (a descending sort for the
        latest would read every key of every kept round: with 1,000 nodes joining at once, O(N²))."""
        base = rendezvous_key(self.job, prefix=self.prefix)
        response = self._call("find the oldest round", lambda: self._client.get_prefix_response(
            base, keys_only=True, limit=1))
        if not response.kvs:
            return 0
        return int(response.kvs[0].key.decode()[len(base):].partition("/")[0])

    # -- joining and closing ----------------------------------------------------------------------------

    def _key(self, number: int, *parts: str) -> str:
        return rendezvous_key(self.job, number, *parts, prefix=self.prefix)

    def _join(self, number: int) -> Round | tuple[int, str]:
        """One transaction: join ``number`` unless it is closed; (join revision, closer) or the closed round."""
        tx = self._client.transactions
        members, by = self._key(number, "close", "members"), self._key(number, "close", "by")
        value = json.dumps({"node": self.node, "joined_at": self._wall()})
        ok, responses = self._call("join the round", lambda: self._client.transaction(
            compare=[tx.version(members) == 0],
            success=[tx.put(self._key(number, "nodes", self.node), value, self._lease),
                     tx.txn([tx.version(by) == 0], [tx.put(by, self.node, self._lease)], [tx.get(by)])],
            failure=[tx.get(members)]))
        if not ok:
            value, _ = responses[0][0]
            return self._parse_members(number, value)
        inner = responses[1].response_txn
        closer = self.node if inner.succeeded else inner.responses[0].response_range.kvs[0].value.decode()
        return responses[0].response_put.header.revision, closer

    def _rejoin(self, number: int) -> None:
        """Put this node's key (and, as the closer, ``close/by``) back into open round ``number`` with the new
        lease (``lease_renewed``). A round that closed meanwhile is left alone: its members' event says the rest."""
        tx = self._client.transactions
        members, by = self._key(number, "close", "members"), self._key(number, "close", "by")
        value = json.dumps({"node": self.node, "joined_at": self._wall(), "rejoined": True})
        again = [tx.put(self._key(number, "nodes", self.node), value, self._lease)]
        if self._closing:
            again.append(tx.txn([tx.version(by) == 0], [tx.put(by, self.node, self._lease)], []))
        ok, _ = self._call("join the round again", lambda: self._client.transaction(
            compare=[tx.version(members) == 0], success=again, failure=[]))
        if ok:
            logger.warning("job %s: node %s's lease lapsed while it waited in round %d; it joined again with a "
                           "new lease", self.job, self.node, number)

    def _await_close(self, number: int, revision: int, deadline: float) -> Round:
        """Wait on ``close/`` for the membership; take the closer's part over if its lease ends first.

        Every ``resync_s`` without an event, read ``close/`` instead: a watch that lost its events (a stream
        that broke, or a client bug) costs a few seconds, never the round."""
        events: queue.Queue = queue.Queue()
        self._wake, self._closing = events, False
        close_prefix = self._key(number, "close") + "/"
        watch_id = self._call("watch the round's close", lambda: self._client.add_watch_prefix_callback(
            close_prefix, events.put, start_revision=revision + 1))
        try:
            while True:
                batch = self._next_events(events, deadline, number, self._clock() + self.config.resync_s)
                if not batch:  # silence: read what the watch would have said
                    members, _ = self._call("read the round's members", lambda: self._client.get(
                        close_prefix + "members"))
                    if members is not None:
                        return self._parse_members(number, members)
                    by, _ = self._call("read the round's closer", lambda: self._client.get(close_prefix + "by"))
                    if by is None and self._take_over(number):
                        self._cancel(watch_id)
                        watch_id = None
                        return self._close(number, deadline)
                for event in batch:
                    name = event.key.decode()[len(close_prefix):]
                    if name == "members" and isinstance(event, PutEvent):
                        return self._parse_members(number, event.value)
                    if name == "by" and isinstance(event, DeleteEvent) and self._take_over(number):
                        self._cancel(watch_id)
                        watch_id = None
                        return self._close(number, deadline)
        finally:
            self._wake = None
            if watch_id is not None:
                self._cancel(watch_id)

    def _take_over(self, number: int) -> bool:
        tx = self._client.transactions
        members, by = self._key(number, "close", "members"), self._key(number, "close", "by")
        ok, _ = self._call("take over closing the round", lambda: self._client.transaction(
            compare=[tx.version(members) == 0, tx.version(by) == 0],
            success=[tx.put(by, self.node, self._lease)], failure=[]))
        if ok:
            logger.info("job %s: round %d's closer is gone; %s closes it", self.job, number, self.node)
        return ok

    def _read_round(self, number: int, rule: CloseRule) -> tuple[int, Round | None]:
        """Read the round's keys into ``rule`` (joins replaced): (the read's revision, the round if closed)."""
        round_prefix, nodes = self._key(number), self._key(number, "nodes") + "/"
        current = self._call("read the round's nodes", lambda: self._client.get_prefix_response(
            round_prefix, keys_only=True))
        rule.joined.clear()
        for kv in current.kvs:
            key = kv.key.decode()
            if key.startswith(nodes):
                rule.join(key[len(nodes):], kv.create_revision)
            elif key == round_prefix + "close/members":  # closed by a closer that took over
                value, _ = self._call("read the round's members", lambda: self._client.get(key))
                return current.header.revision, self._parse_members(number, value)
        return current.header.revision, None

    def _close(self, number: int, deadline: float) -> Round:
        """The closer: watch the round's keys (and the previous round's nodes) until ``CloseRule`` closes it;
        every ``resync_s`` without an event, read the round again (see ``_await_close``)."""
        events: queue.Queue = queue.Queue()
        self._wake, self._closing = events, True
        watches, rule = [], CloseRule(self.config)
        leases: dict[str, int] = {}  # the previous round's members' leases: the last call checks their keep-alives
        next_lease_check = 0.0
        round_prefix, prev_nodes = self._key(number), self._key(number - 1, "nodes") + "/" if number else None
        nodes = self._key(number, "nodes") + "/"
        try:
            if prev_nodes is not None:
                value, _ = self._call("read the previous round", lambda: self._client.get(
                    self._key(number - 1, "close", "members")))
                if value is not None:
                    rule.set_previous(json.loads(value)["members"])
                    alive = self._call("read the previous round's nodes", lambda: self._client.get_prefix_response(
                        prev_nodes, keys_only=True))
                    leases = {kv.key.decode()[len(prev_nodes):]: kv.lease for kv in alive.kvs}
                    for node in rule.previous - leases.keys():
                        rule.previous_gone(node)
                    watches.append(self._call("watch the previous round", lambda: self._client.add_watch_prefix_callback(
                        prev_nodes, events.put, start_revision=alive.header.revision + 1)))
            as_of, closed = self._read_round(number, rule)
            if closed is not None:
                return closed
            watches.append(self._call("watch the round's nodes", lambda: self._client.add_watch_prefix_callback(
                round_prefix, events.put, start_revision=as_of + 1)))
            while True:
                decision = rule.decide(self._clock())
                if not decision.close and rule.awaited() and self._clock() >= next_lease_check:
                    next_lease_check = self._clock() + LEASE_CHECK_S
                    for node in sorted(rule.awaited()):
                        if self._missed_keep_alives(number, node, leases.get(node, 0)):
                            rule.presume_lost(node)
                    decision = rule.decide(self._clock())
                if decision.close:
                    for watch_id in watches:
                        self._cancel(watch_id)
                    watches = []
                    return self._write_close(number, rule.members(), decision.reason, as_of)
                resync_at = self._clock() + self.config.resync_s
                wake_at = min(decision.wake_at or resync_at, resync_at)
                if rule.awaited():
                    wake_at = min(wake_at, next_lease_check)
                batch = self._next_events(events, deadline, number, wake_at)
                if not batch and self._clock() >= resync_at:
                    as_of, closed = self._read_round(number, rule)
                    if closed is not None:
                        return closed
                for event in batch:
                    key = event.key.decode()
                    if key.startswith(nodes) and event.mod_revision > as_of:  # older: in the last read already
                        as_of = event.mod_revision
                        node = key[len(nodes):]
                        if isinstance(event, PutEvent):
                            rule.join(node, event.create_revision)
                        else:
                            rule.leave(node)
                    elif prev_nodes is not None and key.startswith(prev_nodes) and isinstance(event, DeleteEvent):
                        self._back_or_gone(number, key[len(prev_nodes):], rule)
                    elif key == round_prefix + "close/members" and isinstance(event, PutEvent):
                        return self._parse_members(number, event.value)  # closed by a closer that took over
        finally:
            self._wake = None
            for watch_id in watches:
                self._cancel(watch_id)

    def _back_or_gone(self, number: int, node: str, rule: CloseRule) -> None:
        """A member of the previous round whose key there went: back if its key in round ``number`` is there (it left
        to re-join, and ``next_round`` joins before it leaves), else gone. Read, not waited for on the round's watch:
        etcd may deliver the two watches' events in either order (an unsynced watch catches up in batches), and a
        closer that took several re-joining members for lost closed at ``min_nodes`` without them."""
        value, meta = self._call("read whether a member re-joined", lambda: self._client.get(
            self._key(number, "nodes", node)))
        if value is not None:
            rule.join(node, meta.create_revision)
        rule.previous_gone(node)

    def _missed_keep_alives(self, number: int, node: str, lease_id: int) -> bool:
        """Whether ``node``'s lease (its key in the previous round) has gone unrenewed for two of its keep-alive
        periods (a third of its TTL, as the rendezvous handler renews it): less than a third of its TTL is left.
        A lease etcd cannot say anything about, or one granted for under 3 s (the remaining TTL is in whole
        seconds), is not judged."""
        ask = getattr(self._client, "get_lease_info", None)
        if not lease_id or ask is None:
            return False
        try:
            info = ask(lease_id)
        except ETCD_CLIENT_ERRORS:
            return False
        granted, remaining = int(info.grantedTTL), int(info.TTL)
        if remaining < 0 or granted < 3 or remaining * 3 >= granted:  # gone (its key's deletion says so) or alive
            return False
        logger.warning("job %s: node %s of round %d has not renewed its lease for two keep-alive periods (%d s of "
                       "%d s left): taken for lost, round %d does not wait for it", self.job, node, number - 1,
                       remaining, granted, number)
        return True

    def _write_close(self, number: int, members: list[str], reason: str, as_of: int) -> Round:
        """The closing transaction: the membership if none is there yet (and the previous round's keys go)."""
        tx = self._client.transactions
        key = self._key(number, "close", "members")
        value = json.dumps({"round": number, "members": members, "closed_by": self.node, "reason": reason,
                            "as_of": as_of, "closed_at": self._wall()})
        success = [tx.put(key, value)]
        if number >= 1:
            old = self._key(number - 1)
            success.append(tx.delete(old, range_end=prefix_range_end(old.encode())))
        ok, responses = self._call("close the round", lambda: self._client.transaction(
            compare=[tx.version(key) == 0], success=success, failure=[tx.get(key)]))
        if not ok:
            return self._parse_members(number, responses[0][0][0])
        logger.info("job %s: round %d closed by %s with %d nodes (%s)", self.job, number, self.node, len(members),
                    reason)
        return Round(number, self.node, tuple(members), self.node, reason, as_of)

    def _leave(self, number: int) -> None:
        self._call("leave the round", lambda: self._client.delete(self._key(number, "nodes", self.node)))

    # -- helpers -----------------------------------------------------------------------------------------

    def _became_member(self, round_: Round) -> Round:
        self.last = round_
        return round_

    def _parse_members(self, number: int, value: bytes) -> Round:
        record = json.loads(value)
        return Round(number, self.node, tuple(record["members"]), record["closed_by"], record.get("reason", ""),
                     int(record["as_of"]))

    def _next_events(self, events: queue.Queue, deadline: float, number: int, wake_at: float | None = None):
        """The events of the next watch response; none once ``wake_at`` passes; a timeout at ``deadline``."""
        now = self._clock()
        if self._closed is not None and now - self._closed_asked >= self.config.resync_s:
            self._closed_asked = now
            if self._closed():
                raise NativeRendezvousClosed(f"job {self.job}: the rendezvous was closed (the job ended) while node "
                                             f"{self.node} waited in round {number}; nothing to wait for")
        if now >= deadline:
            raise NativeRendezvousTimeout(
                f"job {self.job}: round {number} did not close with node {self.node} within "
                f"{self.config.join_timeout_s:g} s (min_nodes={self.config.min_nodes}): start more nodes, lower "
                f"min_nodes, or check that the previous round's members re-join")
        try:
            response = events.get(timeout=max(0.0, min(deadline, wake_at or deadline) - now))
        except queue.Empty:
            return []
        if response is _REJOIN:
            self._rejoin(number)
            return []
        if isinstance(response, BaseException):
            raise NativeRendezvousUnavailable(
                f"job {self.job}: the etcd watch of rendezvous round {number} failed "
                f"({describe_etcd_error(response)}); check that etcd is up, then call next_round() again"
            ) from response
        return response.events

    def _cancel(self, watch_id) -> None:
        try:
            self._client.cancel_watch(watch_id)
        except ETCD_CLIENT_ERRORS:
            pass

    def _call(self, what: str, op: Callable[[], Any]) -> Any:
        try:
            return with_failover(self._client, op)
        except ETCD_CLIENT_ERRORS as exc:
            text = describe_etcd_error(exc)
            if "lease not found" in text.lower():
                raise NativeRendezvousError(
                    f"job {self.job}: node {self.node} could not {what}: its etcd lease has ended ({text}); "
                    f"grant the node a new lease and rejoin with a new NativeRendezvous") from exc
            raise NativeRendezvousUnavailable(
                f"job {self.job}: node {self.node} could not {what} in etcd ({text}); check that etcd is running "
                f"and that the endpoints given are its client URLs, then call next_round() again") from exc

"""A restart's rendezvous round closes as soon as the previous round's living members are back.

torch's dynamic rendezvous closes a round when ``max_nodes`` have joined, or when its last call runs out,
``last_call_timeout`` after the ``min_nodes``-th joined. After a node is lost, the survivors come back
within a second or two of each other; the round then waits out the whole last call for nodes that will not
come. That wait was 3 s of every node-loss recovery on the test bed (BENCHMARKS.md, issue 14).

A node that has completed a round before knows who was in it. When it re-joins, it marks the new round
complete as soon as:

* it is a participant of the open round, which has at least ``min_nodes`` (torch's last call has started);
* no node is on the wait list (a joining node is always waited for);
* every member of its previous round that is still alive is a participant again.

"Alive" is torch's own rule for dead nodes, applied to the heartbeats this node has seen: a member whose
latest heartbeat is older than ``keep_alive_interval × keep_alive_max_attempt`` is dead. A member that left
the old round cleanly deletes its heartbeat as it leaves, but the heartbeat this node saw before that
stays fresh for the whole window; so a survivor that is slow to re-join is waited for, and a dead node is
not. The last call still bounds the wait either way. The first round of a launcher, and every round of a
node that never completed one, keep torch's rule unchanged.

torch builds its join operation inside ``DynamicRendezvousHandler.next_rendezvous`` from the module's
``_RendezvousJoinOp`` class, so the check is a subclass installed there. It acts only while a handler set
up by ``close_when_members_rejoin`` is in ``next_rendezvous`` on the same thread; any other handler in the
process gets torch's behaviour. torch 2.13's join operation and state are what this was written against;
if those names move, the handler keeps torch's rule and says so once in the log.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timezone
from typing import Any, Callable

from torch.distributed.elastic.rendezvous import RendezvousHandler
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as _dr

logger = logging.getLogger(__name__)

__all__ = ["MemberTracker", "close_when_members_rejoin"]

_STOCK_JOIN_OP: type | None = getattr(_dr, "_RendezvousJoinOp", None)
_MARK_COMPLETE = getattr(getattr(_dr, "_Action", None), "MARK_RENDEZVOUS_COMPLETE", None)
_active = threading.local()


class MemberTracker:
    """What one node knows of its previous round: its members, and the newest heartbeat seen from each."""

    def __init__(self, *, now: Callable[[], datetime] = lambda: datetime.now(timezone.utc)) -> None:
        self._now = now
        self.previous: frozenset[Any] | None = None
        """The participants of the last round this node completed; ``None`` before its first."""
        self.heard: dict[Any, datetime] = {}
        """Each node's newest heartbeat seen in any state this node read."""
        self.closed_early = 0
        """Rounds this node marked complete before torch's last call ran out."""

    def observe(self, state: Any) -> None:
        for node, beat in state.last_heartbeats.items():
            if node not in self.heard or beat > self.heard[node]:
                self.heard[node] = beat

    def completed(self, state: Any) -> None:
        """Remember the members of the round ``next_rendezvous`` just returned."""
        self.previous = frozenset(state.participants) if state.complete else None
        self.heard = {node: beat for node, beat in self.heard.items() if node in state.last_heartbeats}

    def alive(self, settings: Any) -> set[Any]:
        """The previous round's members whose newest heartbeat is within torch's dead-node window."""
        if self.previous is None:
            return set()
        oldest = self._now() - settings.keep_alive_interval * settings.keep_alive_max_attempt
        return {node for node in self.previous if node in self.heard and self.heard[node] >= oldest}

    def ready(self, ctx: Any) -> bool:
        """Whether ``ctx.node`` may mark the open round complete now (the rules in the module's docstring)."""
        state, settings = ctx.state, ctx.settings
        if self.previous is None or state.closed or state.complete or ctx.node not in state.participants:
            return False
        if state.deadline is None or state.wait_list or state.redundancy_list:
            return False
        if not settings.min_nodes <= len(state.participants) <= settings.max_nodes:
            return False
        return self.alive(settings) <= state.participants.keys()


if _STOCK_JOIN_OP is not None and _MARK_COMPLETE is not None:

    class _JoinOpClosingOnMembers(_STOCK_JOIN_OP):  # type: ignore[misc, valid-type]
        """torch's join operation, which also closes the round once the previous round's living members are in."""

        def __call__(self, ctx: Any, deadline: float) -> Any:
            tracker: MemberTracker | None = getattr(_active, "tracker", None)
            if tracker is not None and time.monotonic() <= deadline:
                tracker.observe(ctx.state)
                if tracker.ready(ctx):
                    tracker.closed_early += 1
                    logger.info("rendezvous round %d: the %d members of the previous round that are alive "
                                "have joined; closing it without waiting the last call", ctx.state.round,
                                len(ctx.state.participants))
                    return _MARK_COMPLETE
            return super().__call__(ctx, deadline)
else:  # pragma: no cover - a torch whose dynamic rendezvous moved these names
    _JoinOpClosingOnMembers = None


def close_when_members_rejoin(handler: RendezvousHandler) -> MemberTracker | None:
    """Make ``handler``'s restart rounds close once the previous round's living members are back.

    Returns the handler's tracker, or ``None`` when this torch's dynamic rendezvous does not have the
    pieces (the handler then keeps torch's rule, and the log says so)."""
    holder = getattr(handler, "_state_holder", None)
    if _JoinOpClosingOnMembers is None or holder is None or not hasattr(holder, "state"):
        logger.warning("this torch's dynamic rendezvous lacks the join operation or state holder members.py "
                       "builds on; restart rounds wait out their last call")
        return None
    if _dr._RendezvousJoinOp is _STOCK_JOIN_OP:
        _dr._RendezvousJoinOp = _JoinOpClosingOnMembers
    tracker = MemberTracker()
    next_rendezvous = handler.next_rendezvous

    def next_rendezvous_closing_on_members():
        tracker.observe(holder.state)
        _active.tracker = tracker
        try:
            info = next_rendezvous()
        finally:
            _active.tracker = None
        tracker.completed(holder.state)
        return info

    handler.next_rendezvous = next_rendezvous_closing_on_members  # type: ignore[method-assign]
    return tracker

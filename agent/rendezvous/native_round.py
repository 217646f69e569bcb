"""What a native rendezvous round is, apart from etcd: its settings, a closed round, the rule that closes it, and
the errors a node waiting for one meets (agent/rendezvous/native.py has the protocol: keys, joins, the close
transaction, the watches; its docstring says how a round closes).

**Ranks**: the members are the first ``max_nodes`` joins (by etcd create revision), except that after the first
round a member of the previous round that is back always goes before a newcomer, and a full round still waits for
the previous round's living members (several spares, waiting in the round before the survivors re-joined it, must
not push a survivor out); a node's rank is its index
in the membership, the same on every node without another exchange. A job's first round sorts them by node id;
a later round keeps the previous round's order: each member that is back keeps its position, a node that was
not in it (a hot spare, a node that came back) takes a lost member's position, in join order, and any left
over go after the others, while positions nobody fills are closed up. So a spare that replaces a lost node
takes the lost node's ranks and the survivors keep theirs (no resharding at the same world size).

``CloseRule`` is pure (no etcd; the caller gives the time), so the closing rule is tested with a fake clock
(tests/unit/test_rendezvous_native.py). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CloseRule", "Decision", "NativeRendezvousClosed", "NativeRendezvousConfig", "NativeRendezvousError",
           "NativeRendezvousTimeout", "NativeRendezvousUnavailable", "Round"]


class NativeRendezvousError(Exception):
    """Base of the native rendezvous' errors; as such (a node's lease has ended, a bad name): not retryable."""


class NativeRendezvousUnavailable(NativeRendezvousError, ConnectionError):
    """etcd did not answer. Retryable once etcd is back."""


class NativeRendezvousClosed(NativeRendezvousError):
    """The job's rendezvous was closed (the job ended) while this node waited for a round: nothing to wait for.
    Not retryable; a hot spare that was never needed ends here."""


class NativeRendezvousTimeout(NativeRendezvousError, TimeoutError):
    """No round closed with this node in time: fewer than ``min_nodes`` came, or the others stayed in their
    round. Not retryable as is: start more nodes, or lower ``min_nodes``."""


@dataclass(frozen=True, kw_only=True)
class NativeRendezvousConfig:
    """How many nodes a round takes and how long it waits for them."""

    min_nodes: int
    """The fewest nodes a round closes with."""
    max_nodes: int
    """The most nodes a round takes; it closes at once when this many have joined."""
    last_call_s: float = 3.0
    """How long a round waits for more nodes once ``min_nodes`` have joined."""
    join_timeout_s: float = 600.0
    """How long ``next_round`` waits for a round with this node in it before ``NativeRendezvousTimeout``."""
    resync_s: float = 5.0
    """After this long without a watch event, a waiting node reads the round instead (a lost watch costs this)."""

    def __post_init__(self) -> None:
        if not isinstance(self.min_nodes, int) or not isinstance(self.max_nodes, int) or self.min_nodes < 1:
            raise ValueError(f"min_nodes={self.min_nodes!r} and max_nodes={self.max_nodes!r} must be whole numbers >= 1")
        if self.max_nodes < self.min_nodes:
            raise ValueError(f"max_nodes={self.max_nodes} is below min_nodes={self.min_nodes}; give MIN <= MAX")
        if not self.last_call_s >= 0:
            raise ValueError(f"last_call_s={self.last_call_s!r} must be >= 0 seconds")
        if not self.resync_s > 0:
            raise ValueError(f"resync_s={self.resync_s!r} must be > 0 seconds")
        if not self.join_timeout_s > 0:
            raise ValueError(f"join_timeout_s={self.join_timeout_s!r} must be > 0 seconds")


@dataclass(frozen=True)
class Round:
    """A closed round as one node sees it."""

    number: int
    node: str
    members: tuple[str, ...]
    """Every member's node id, sorted: the rank order."""
    closed_by: str
    reason: str
    as_of: int
    """The etcd revision the membership was read at: a member's key deleted after it ends the round."""

    @property
    def rank(self) -> int:
        """This node's rank among the members (ValueError when it is not one)."""
        return self.members.index(self.node)

    @property
    def world_size(self) -> int:
        return len(self.members)


@dataclass(frozen=True)
class Decision:
    close: bool
    reason: str
    wake_at: float | None = None
    """When to decide again without a new event (the last call's end); None: only on the next event."""


class CloseRule:
    """When the closer closes its round, from what it has seen (pure: no etcd; the caller gives the time).

    ``previous`` is the membership of the round before (None for a job's first round), ``gone`` the members
    of it whose key has gone since. That round is *intact* while none has gone and none has joined this one:
    then this round waits (its nodes came after the other closed)."""

    def __init__(self, config: NativeRendezvousConfig, *, previous: frozenset[str] | None = None) -> None:
        self.config = config
        self.previous = previous
        self.gone: set[str] = set()
        self.joined: dict[str, int] = {}
        """Each joined node's create revision: join order."""
        self.last_call_ends: float | None = None
        self.presumed: set[str] = set()
        """Members of the previous round taken for lost before their key went: their lease missed its keep-alives."""
        self.previous_order: tuple[str, ...] = ()
        """The previous round's members in rank order (``set_previous``): the positions ``members`` keeps."""

    def set_previous(self, members) -> None:
        """The previous round's membership, in its rank order."""
        self.previous_order = tuple(members)
        self.previous = frozenset(self.previous_order)

    def join(self, node: str, revision: int) -> None:
        self.joined.setdefault(node, revision)

    def leave(self, node: str) -> None:
        self.joined.pop(node, None)

    def previous_gone(self, node: str) -> None:
        if self.previous is not None and node in self.previous:
            self.gone.add(node)

    def presume_lost(self, node: str) -> None:
        """A member of the previous round whose lease has not been renewed for two of its keep-alive periods: a
        node powered off or cut off, whose key will go when the lease runs out. The last call does not wait for
        it; if it was alive after all, it joins the next round and waits there, as a node that came late."""
        if self.previous is not None and node in self.previous:
            self.gone.add(node)
            self.presumed.add(node)

    def awaited(self) -> frozenset[str]:
        """The previous round's members the last call is waiting for (neither back nor gone); empty outside it."""
        if self.previous is None or self.last_call_ends is None:
            return frozenset()
        return frozenset(self.previous - self.gone - self.joined.keys())

    def decide(self, now: float) -> Decision:
        count = len(self.joined)
        if self.previous is not None and not self.gone and not self.previous & self.joined.keys():
            self.last_call_ends = None
            return Decision(False, "the previous round is intact")
        # after a loss, a full round still waits for the previous round's living members: newcomers (spares that
        # waited in this round before the survivors re-joined it) must not take a survivor's place
        living_back = self.previous is None or (self.previous - self.gone) <= self.joined.keys()
        if count >= self.config.max_nodes and living_back:
            return Decision(True, f"max_nodes={self.config.max_nodes} joined")
        if count < self.config.min_nodes:
            self.last_call_ends = None
            return Decision(False, f"{count} of min_nodes={self.config.min_nodes} joined")
        if self.previous is not None and living_back:
            late = sorted(self.presumed - self.joined.keys())
            return Decision(True, "every living member of the previous round is back" + (
                f" ({', '.join(late)}: lease not renewed for two keep-alive periods, taken for lost)" if late else ""))
        if self.last_call_ends is None:
            self.last_call_ends = now + self.config.last_call_s
        if now >= self.last_call_ends:
            return Decision(True, f"last call ({self.config.last_call_s:g} s) over with {count} nodes")
        return Decision(False, "last call", self.last_call_ends)

    def members(self) -> list[str]:
        """At most ``max_nodes`` joins in rank order: the first by join order, sorted by node id, in a job's first
        round; after it, every member of the previous round that is back, in that round's order, a newcomer (in join
        order) in the place of each member that is not, the newcomers left over after them (**Ranks**
        above). A member that is back always comes before a newcomer, however long the newcomer waited."""
        by_join = sorted(self.joined, key=lambda n: (self.joined[n], n))
        if not self.previous_order:
            return sorted(by_join[: self.config.max_nodes])
        back = [n for n in self.previous_order if n in self.joined][: self.config.max_nodes]
        newcomers = [n for n in by_join if n not in self.previous][: self.config.max_nodes - len(back)]
        order = []
        for node in self.previous_order:
            if node in back:
                order.append(node)
            elif newcomers:
                order.append(newcomers.pop(0))
        return order + newcomers

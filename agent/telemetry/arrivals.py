"""Who waited for whom: collective arrivals matched across a node's ranks.

On gloo the Flight Recorder records when each collective was enqueued and nothing about when it
finished. One collective, though, is one (process group, sequence id) on every member rank, and a
blocking collective completes for all members only once the last member has arrived. So, for the ranks
of a group that run on this node:

    departure(c)          = latest arrival at c among the members     (when c could complete)
    waited(r, c)          = departure(c) - arrival(r, c)
    compute(r, c -> next) = arrival(r, next) - departure(c)           (what r did between c and its next)

Each rank's consecutive collectives (a, b) on its training thread give one interval: total time
``arrival(b) - arrival(a)`` of which ``arrival(b) - departure(a)`` was the rank's own work. A straggler
arrives last, never waits, and its intervals are all compute; its peers' intervals are mostly waiting.
The straggler detector (agent/watchdog/straggler.py) compares the compute share of these intervals across ranks.

This is exact where the estimate from enqueue times alone (enqueue to next enqueue) is not: tensor-parallel
layers compute between collectives, which that estimate counts as waiting. Limits, documented rather
than guessed around:

- Only members on this node are matched (clocks of one host agree; across hosts they do not to the
  microsecond). A group with no other local member gives no intervals: its waits are for remote peers.
- Asynchronous collectives are not waited for at their enqueue; their "wait" is spread over the compute
  that overlaps them, the same way on every rank, so ratios between peers survive.
- A collective some local member never reports (its recorder ring wrapped before a read) is given up as
  soon as that member reports a later collective of the same group (sequence ids only grow), or after
  `expire_s` if it reports nothing more; intervals are formed only inside unbroken stretches of a rank's
  arrivals.

Not thread-safe: the JobTelemetry calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Iterable, Mapping

__all__ = ["Arrival", "ArrivalMatcher", "Interval"]

_MAX_QUEUE = 20_000      # arrivals waiting per rank for their collective's other members
_MAX_KEYS = 200_000      # collectives being matched
_MAX_INTERVALS = 50_000  # resolved intervals per rank not yet taken by the watchdog
_MAX_OPS = 32            # distinct op names whose waits are kept per rank


@dataclass(frozen=True)
class Arrival:
    """One collective entered by one rank's training thread."""

    group: str
    seq: int
    enqueued_ns: int
    op: str = ""
    """The collective ("all_reduce"); names the wait it ends in."""


@dataclass(frozen=True)
class Interval:
    """From one of a rank's collectives to its next: how long, and how much of it was its own work."""

    end_ns: int
    total_ns: int
    compute_ns: int


class _RankArrivals:
    __slots__ = ("queue", "newest_ns", "last_seq", "intervals", "waits")

    def __init__(self) -> None:
        self.queue: deque[tuple[Arrival, bool]] = deque()  # (arrival, starts a new unbroken stretch)
        self.newest_ns = 0
        self.last_seq: dict[str, int] = {}  # highest sequence id reported per group
        self.intervals: deque[Interval] = deque(maxlen=_MAX_INTERVALS)
        self.waits: dict[str, int] = {}  # op -> ns waited in matched collectives, not yet taken


class ArrivalMatcher:
    """Matches one job's collective arrivals across its local ranks; see the module docstring."""

    def __init__(self, *, expire_s: float = 30.0) -> None:
        self._expire_ns = int(expire_s * 1e9)
        self._members: dict[str, frozenset[int]] = {}
        self._keys: OrderedDict[tuple[str, int], dict[int, int]] = OrderedDict()
        self._ranks: dict[int, _RankArrivals] = {}

    def set_members(self, group: str, ranks: Iterable[int]) -> None:
        self._members[group] = frozenset(int(r) for r in ranks)

    def reset(self) -> None:
        """Forget every arrival (a new worker round: sequence ids start again); group members stay."""
        self._keys.clear()
        self._ranks.clear()

    def add(self, rank: int, arrivals: Iterable[Arrival], *, continues: bool) -> None:
        state = self._ranks.setdefault(rank, _RankArrivals())
        first = not continues
        for a in arrivals:
            key = (a.group, a.seq)
            seen = self._keys.get(key)
            if seen is None:
                if len(self._keys) >= _MAX_KEYS:
                    self._keys.popitem(last=False)
                seen = self._keys[key] = {}
            seen[rank] = a.enqueued_ns
            if len(state.queue) >= _MAX_QUEUE:
                state.queue.popleft()
                first = True if not state.queue else first
            state.queue.append((a, first))
            state.newest_ns = max(state.newest_ns, a.enqueued_ns)
            state.last_seq[a.group] = max(state.last_seq.get(a.group, -1), a.seq)
            first = False

    def resolve(self, local_ranks: Iterable[int]) -> None:
        """Turn arrivals whose collective is matched (or given up) into intervals."""
        local = frozenset(local_ranks)
        for rank, state in self._ranks.items():
            self._resolve_rank(rank, state, local)
        self._prune(local)

    def take(self) -> dict[int, list[Interval]]:
        """Intervals resolved since the last call, per rank, oldest first."""
        out = {}
        for rank, state in self._ranks.items():
            if state.intervals:
                out[rank] = list(state.intervals)
                state.intervals.clear()
        return out

    def take_waits(self) -> dict[int, dict[str, float]]:
        """Seconds each rank waited in matched collectives since the last call, per op: its departure (the
        last member's arrival) minus its own arrival. Collectives with no other local member are not in it."""
        out = {}
        for rank, state in self._ranks.items():
            if state.waits:
                out[rank] = {op: ns / 1e9 for op, ns in state.waits.items()}
                state.waits.clear()
        return out

    def pending(self) -> Mapping[int, int]:
        """Arrivals waiting per rank (for tests and debugging)."""
        return {r: len(s.queue) for r, s in self._ranks.items()}

    def _departure(self, a: Arrival, rank: int, local: frozenset[int]) -> int | None | bool:
        """Latest arrival among the local members; None: not all arrived yet; False: cannot be matched."""
        members = self._members.get(a.group)
        if members is None or rank not in members:
            return False
        expected = (members & local) | {rank}
        if len(expected) < 2:
            return False
        seen = self._keys.get((a.group, a.seq), {})
        if not expected <= seen.keys():
            missing = [self._ranks.get(r) for r in expected - seen.keys()]
            if any(m is not None and m.last_seq.get(a.group, -1) > a.seq for m in missing):
                return False  # a member is past this collective without reporting it: its entry was lost
            # a member that never sent anything is judged by this rank's own progress
            horizon = min(m.newest_ns if m is not None else self._ranks[rank].newest_ns for m in missing)
            if horizon - a.enqueued_ns > self._expire_ns:
                return False  # the missing members moved on long ago: their entry was lost
            return None
        return max(seen[r] for r in expected)

    def _resolve_rank(self, rank: int, state: _RankArrivals, local: frozenset[int]) -> None:
        queue = state.queue
        while len(queue) >= 2:
            a, _ = queue[0]
            b, b_starts = queue[1]
            if b_starts:
                queue.popleft()
                continue
            departure = self._departure(a, rank, local)
            if departure is None:
                return
            queue.popleft()
            if departure is False:
                continue
            waited = max(0, departure - a.enqueued_ns)
            op = a.op or "unknown"
            if op in state.waits or len(state.waits) < _MAX_OPS:  # a zero wait still names the op
                state.waits[op] = state.waits.get(op, 0) + waited
            total = b.enqueued_ns - a.enqueued_ns
            if total <= 0:
                continue
            compute = min(total, max(0, b.enqueued_ns - departure))
            state.intervals.append(Interval(b.enqueued_ns, total, compute))

    def _prune(self, local: frozenset[int]) -> None:
        heads = [s.queue[0][0].enqueued_ns for r, s in self._ranks.items() if s.queue and r in local]
        if not heads:
            self._keys.clear()
            return
        floor = min(heads) - self._expire_ns
        while self._keys:
            key, seen = next(iter(self._keys.items()))
            if seen and max(seen.values()) >= floor:
                break
            self._keys.popitem(last=False)

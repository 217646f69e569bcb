"""Straggler detection: score each rank's compute share against its peers', with persistence and hysteresis.

In synchronous training every rank's step takes as long as the slowest rank's, so step time cannot find
a straggler. What differs is how the time is spent: the straggler computes and never waits, its peers
compute as much as usual and wait for it. The input is a stream of intervals per rank (agent/telemetry/arrivals.py:
from one collective to the next on gloo, matched across the node's ranks; one per collectives record
where NCCL measures durations), each with its total length and the part that was the rank's own work.
The data's own clock is cut into slices one step time long, and never shorter than `min_slice_s` (0.5 s);
each slice scores every rank against its peers, and a rank's score is the median of its slice scores over
the last `window_steps` slices:

    compute share = compute seconds / total seconds           (of the rank's intervals ending in the slice)
    slice score   = compute share / median compute share of its peers in that slice
    score         = median of the rank's slice scores in the window

1.0 means as busy as a typical peer. A rank is flagged when its score stays above `start_score` (1.15) for
`persist_steps` (7) slices and `persist_s` (3 s) of the job's time, and cleared when it stays below
`clear_score` (1.1) for `clear_persist_steps` (5) slices and `clear_s` (3 s), and never before the flag has
been up `min_flag_s` (10 s) by the agent's clock. A start also needs the cost to be real: the window median
of how much longer its peers waited than it did, as a share of the job's time, at least `min_wait_share`
(0.13, what a rank 1.15x slower costs). The score is a ratio over the intervals the node can match, and
when those cover little of the step (tensor parallelism on the node, the data-parallel all-reduce with
other nodes) a small systematic extra of rank 0 (checkpoint coordination, logging) scored 1.16-1.29 while
its peer waited for it 10% of the time (`make demo-cluster`, tests/fixtures/straggler/cluster3n).

Why seconds as well as steps: on short steps, scheduling noise of a few milliseconds is a large share of
one step, and a one-step slice made a straggler of whichever rank the noise hit; persistence counted in
steps was then met at once when a read of 60 steps arrived together (a balanced 4-rank DDP job with 25 ms
steps gave a stream of starts and ends, each held for 0-2 s). With the floors, a slice of that job holds
about 20 steps and a flag needs seconds of evidence. The settings were chosen by replaying recorded input
of real jobs (tests/fixtures/straggler/): DDP with 10 ms, 25 ms and 0.5 s steps, FSDP with a checkpoint
every 5 steps, the 3-D reference job on 4 and 8 ranks; their highest score held for 7 slices was 1.10
(the 8-rank 3-D job), the others 1.00-1.05, while ranks slowed 1.2x-1.3x score 1.19-1.41. The median over
slices makes one long pause (a garbage collection, a slow checkpoint write on one rank) count as one
slice, not as a window's worth; the median over peers (not the fastest) keeps one noisy-fast peer from
inflating every score, and with two ranks it is the other rank. Peers are the ranks doing the same work:
with pipeline parallelism, the ranks of the same stage (stages differ in work by design); the caller
passes that grouping.

Slices follow the data's timestamps, so persistence is counted in the job's time however bursty the data's
arrival is (the runtime reads its Flight Recorder every 1.5 s, or every 6 s while no detector's `near_decision` is True). A slice is scored once every
rank still reporting has data past it, and a rank needs slice scores for at least half the window before
it has a score at all. What the watchdog makes of the flags (one open incident per rank, at most
`max_incidents_per_hour` per job) is in agent/watchdog/loop.py.

A slowdown of the whole peer group is not one rank's: a start also needs the peers' own work to have stayed
where it was (`max_peer_growth`). A straggler's peers do as much work per collective interval as before and only
wait longer. When n1's link of the soak's 3-D job was degraded to 8 Mbit/s, n0's rank 3 was named (the likely
cause: waits for the data-parallel all-reduce across the link land inside the ranks' local intervals, as an
asynchronous collective is waited for later than its enqueue, so the whole stage looked busier, one rank more): rank 3
scored 1.32 against rank 2, busy 74% of steps about 2.5x longer than before the fault, so about twice its work
per step (seed 30, issue 45; estimated from the incident and the step log: no trace was recorded). Each
rank's level is the median of its work per interval over its recent ordinary slices (`baseline_slices`, learned
from each worker round's first scored slices on: `new_round` forgets it; slices that grew more than
`max_peer_growth` are not learned, so a slowdown that lasts does not become the level). That slowdown itself is
the communication-regression watch's (agent/watchdog/comm_regression.py), or, where the ranks' own compute grew
alike (a throttled node), nobody's in particular.

Policy (`StragglerPolicy`): ``alert`` records and flags; ``exclude`` also records that the node should be
left out of the next rendezvous (the cluster side acts on it).
"""

from __future__ import annotations

import bisect
import enum
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, Sequence

from trainwarden.agent.telemetry.arrivals import Interval

__all__ = ["RankScore", "StragglerConfig", "StragglerDetector", "StragglerEvent", "StragglerPolicy"]

_MIN_STRIDE_NS = 10_000_000  # evaluate at most every 10 ms of data
_MAX_POSITIONS = 2000        # positions evaluated per update; older ones are skipped (agent fell behind)
_MIN_SHARE = 1e-3


class StragglerPolicy(str, enum.Enum):
    ALERT = "alert"
    """Flag the rank, export it, record an incident."""
    EXCLUDE = "exclude"
    """As alert, and record that the node should be excluded at the next restart."""


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    """When a rank counts as a straggler."""

    window_steps: int = 14
    """Length of the sliding window, in slices."""
    min_slice_s: float = 0.5
    """A slice is one step time long, but never shorter than this: on short steps a slice holds several, so
    scheduling noise of a few milliseconds does not make a straggler of whichever rank it hit."""
    start_score: float = 1.15
    """Score above which a slice counts towards flagging."""
    persist_steps: int = 7
    """Consecutive slices above `start_score` before the rank is flagged..."""
    persist_s: float = 3.0
    """...and at least this many seconds of the job's time."""
    clear_score: float = 1.1
    """Score below which a slice counts towards clearing the flag."""
    clear_persist_steps: int = 5
    """Consecutive slices below `clear_score` before the flag is cleared..."""
    clear_s: float = 3.0
    """...and at least this many seconds of the job's time..."""
    min_flag_s: float = 10.0
    """...and the flag has been up this long (agent clock): a flag never flickers."""
    min_wait_share: float = 0.13
    """...and its peers wait for it at least this share of the job's time (window median of per-slice waits):
    what a rank `start_score` (1.15) times slower costs them (1 - 1/1.15). A high score from intervals that
    cover little of the step (most of it in collectives with other nodes) costs the job little."""
    warmup_steps: int = 10
    """Steps every rank of a new worker round completes before its data is scored (start-up is noisy)."""
    max_incidents_per_hour: int = 6
    """Straggler incidents a job may open in any hour; beyond it, ranks are still flagged and scored, but
    the incidents are counted as suppressed instead of recorded (a flapping detector must not flood anyone)."""
    min_coverage: float = 0.3
    """Share of a slice a rank's intervals must cover for the rank to be scored in it."""
    max_peer_growth: float = 1.5
    """...and its peers' own work per interval at most this times their level (window median): a straggler's peers
    only wait longer; when they work longer too, the whole group is slower (a degraded link, a throttled node)."""
    baseline_slices: int = 20
    """Ordinary slices a rank's level of work per interval is the median of; until it has `window_steps` // 2 of
    them in a worker round, its peers are not held to it."""
    policy: StragglerPolicy = StragglerPolicy.ALERT
    """What a flagged straggler leads to."""

    def __post_init__(self) -> None:
        if self.window_steps < 2:
            raise ValueError(f"window_steps must be at least 2, got {self.window_steps}")
        if not 1.0 < self.clear_score <= self.start_score:
            raise ValueError(f"need 1 < clear_score <= start_score, got clear_score={self.clear_score} "
                             f"start_score={self.start_score}")
        for name in ("min_slice_s", "persist_s", "clear_s", "min_flag_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be 0 or more, got {getattr(self, name)}")
        if self.persist_steps < 1 or self.clear_persist_steps < 1:
            raise ValueError(f"persist_steps and clear_persist_steps must be at least 1, got "
                             f"{self.persist_steps}, {self.clear_persist_steps}")
        if self.max_incidents_per_hour < 1:
            raise ValueError(f"max_incidents_per_hour must be at least 1, got {self.max_incidents_per_hour}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must not be negative, got {self.warmup_steps}")
        if not 0.0 <= self.min_wait_share < 1.0:
            raise ValueError(f"min_wait_share must be in [0, 1), got {self.min_wait_share}")
        if not 0.0 < self.min_coverage <= 1.0:
            raise ValueError(f"min_coverage must be in (0, 1], got {self.min_coverage}")
        if not self.max_peer_growth > 1.0 or self.baseline_slices < 1:
            raise ValueError(f"max_peer_growth must be above 1 and baseline_slices at least 1, got "
                             f"{self.max_peer_growth}, {self.baseline_slices}")
        object.__setattr__(self, "policy", StragglerPolicy(self.policy))


@dataclass(frozen=True, kw_only=True)
class RankScore:
    """A rank's latest score."""

    rank: int
    score: float
    compute_share: float
    """Share of the rank's time in the window that was its own work."""
    peer_compute_share: float
    """Median compute share of its peers."""
    peer_wait_share: float = 0.0
    """Median share of the job's time its peers waited for it, beyond its own waits."""
    peer_growth: float = 1.0
    """Median of its peers' own work per interval against their level (1.0 while they have none)."""
    window_seconds: float
    slices: int
    """Slice scores the median was taken over."""
    flagged: bool


@dataclass(frozen=True, kw_only=True)
class StragglerEvent:
    """A rank became a straggler (`started`) or stopped being one."""

    job: str
    rank: int
    started: bool
    score: RankScore
    evaluations: int
    """Consecutive slices that led to the event."""
    seconds: float = 0.0
    """The job's time those slices cover."""
    policy: StragglerPolicy


class _RankScoring:
    __slots__ = ("ends", "total", "compute", "slices", "above", "below", "flagged", "flagged_at", "score", "level")

    def __init__(self) -> None:
        # (score, share, peer share, peer wait, peer growth)
        self.slices: deque[tuple[float, float, float, float, float]] = deque()
        self.level: deque[float] = deque()  # own work per interval (s) in recent ordinary slices of this round
        self.ends: list[int] = []
        self.total: list[int] = [0]     # prefix sums: total[i] = sum of the first i intervals
        self.compute: list[int] = [0]
        self.above = 0
        self.below = 0
        self.flagged = False
        self.flagged_at = 0.0  # agent clock
        self.score: RankScore | None = None

    def add(self, interval: Interval) -> None:
        if self.ends and interval.end_ns < self.ends[-1]:
            return  # out of order: the window sums need sorted ends
        self.ends.append(interval.end_ns)
        self.total.append(self.total[-1] + interval.total_ns)
        self.compute.append(self.compute[-1] + interval.compute_ns)

    def sums(self, lo: int, hi: int) -> tuple[int, int, int]:
        """(total, compute, how many) of the intervals ending in (lo, hi]."""
        i, j = bisect.bisect_right(self.ends, lo), bisect.bisect_right(self.ends, hi)
        return self.total[j] - self.total[i], self.compute[j] - self.compute[i], j - i

    def trim(self, before: int) -> None:
        k = bisect.bisect_right(self.ends, before)
        if k > 1024 or (k and k * 2 > len(self.ends)):
            del self.ends[:k], self.total[:k], self.compute[:k]


class _JobScoring:
    def __init__(self) -> None:
        self.ranks: dict[int, _RankScoring] = {}
        self.position: int | None = None  # the last evaluated instant (ns, the data's clock)


class StragglerDetector:
    """Scores and flags per job; not thread-safe (one watchdog thread writes, scrapes read `scores()` copies)."""

    def __init__(self, config: StragglerConfig | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or StragglerConfig()
        self.clock = clock
        self._jobs: dict[str, _JobScoring] = {}

    def update(self, job: str, intervals: Mapping[int, Sequence[Interval]], *, step_seconds: float,
               groups: Mapping[int, Hashable] | None = None) -> list[StragglerEvent]:
        """Feed new intervals per rank; returns the start/end events this caused."""
        state = self._jobs.setdefault(job, _JobScoring())
        for rank, items in intervals.items():
            r = state.ranks.setdefault(rank, _RankScoring())
            for interval in items:
                r.add(interval)
        live = {rank: r for rank, r in state.ranks.items() if r.ends}
        if len(live) < 2 or not step_seconds > 0:
            return []
        cfg = self.config
        stride = max(int(max(step_seconds, cfg.min_slice_s) * 1e9), _MIN_STRIDE_NS)
        window = stride * cfg.window_steps
        newest = max(r.ends[-1] for r in live.values())
        live = {rank: r for rank, r in live.items() if r.ends[-1] >= newest - 2 * window}  # still reporting
        if len(live) < 2:
            return []
        horizon = min(r.ends[-1] for r in live.values())
        if state.position is None:
            state.position = max(r.ends[0] for r in live.values())
        position = max(state.position + stride, horizon - _MAX_POSITIONS * stride)
        events: list[StragglerEvent] = []
        groups = groups or {}
        while position <= horizon:
            events.extend(self._evaluate(job, live, groups, position, stride))
            state.position = position
            position += stride
        for r in state.ranks.values():
            r.trim(state.position - 2 * window)
        return events

    def scores(self) -> dict[str, dict[int, RankScore]]:
        """Latest score of every scored rank, per job."""
        return {job: {r: s.score for r, s in sorted(j.ranks.items()) if s.score is not None}
                for job, j in sorted(self._jobs.items())}

    def near_decision(self, job: str, recent_slices: int = 3) -> bool:
        """True while a decision on a rank of `job` may be near: a rank is flagged (its clearing is being
        judged), its score is above `clear_score`, or the median of its last `recent_slices` slice scores is
        above `start_score` (a straggler's first slices, long before its window score follows). The agent
        reads its workers' Flight Recorders slowly while this is False (agent/watchdog/loop.py)."""
        state = self._jobs.get(job)
        if state is None:
            return False
        cfg = self.config
        for r in state.ranks.values():
            if r.flagged or (r.score is not None and r.score.score > cfg.clear_score):
                return True
            if len(r.slices) >= recent_slices and statistics.median(
                    s[0] for s in list(r.slices)[-recent_slices:]) > cfg.start_score:
                return True
        return False

    def flagged(self, job: str) -> list[int]:
        state = self._jobs.get(job)
        return sorted(r for r, s in state.ranks.items() if s.flagged) if state else []

    def forget(self, job: str) -> None:
        self._jobs.pop(job, None)

    def new_round(self, job: str) -> None:
        """A new worker round of `job` (a restart, a new world size): its ranks' levels of work are learned again."""
        for r in self._jobs.get(job, _JobScoring()).ranks.values():
            r.level.clear()

    def _evaluate(self, job: str, ranks: Mapping[int, _RankScoring], groups: Mapping[int, Hashable], position: int,
                  stride: int) -> list[StragglerEvent]:
        """Score the slice (position - stride, position] and judge every rank on its window of slices."""
        cfg = self.config
        shares: dict[int, float] = {}
        waits: dict[int, float] = {}  # share of the slice the rank spent waiting for its peers
        growth: dict[int, float] = {}  # own work per interval against the rank's level
        for rank, r in ranks.items():
            total, compute, count = r.sums(position - stride, position)
            if total > 0 and total >= cfg.min_coverage * stride:
                shares[rank], waits[rank] = compute / total, (total - compute) / stride
                growth[rank] = self._learn(r, compute / count)
        events = []
        for rank, share in sorted(shares.items()):
            peers = [p for p in shares if p != rank and groups.get(p) == groups.get(rank)]
            if not peers:
                continue
            state = ranks[rank]
            peer_share = max(_MIN_SHARE, statistics.median(shares[p] for p in peers))
            peer_wait = statistics.median(waits[p] for p in peers) - waits[rank]
            peer_growth = statistics.median(growth[p] for p in peers)
            state.slices.append((share / peer_share, share, peer_share, peer_wait, peer_growth))
            while len(state.slices) > cfg.window_steps:
                state.slices.popleft()
            if len(state.slices) * 2 < cfg.window_steps:
                continue
            score, _, _, wait, grew = (statistics.median(column) for column in zip(*state.slices))
            event = self._judge(state, score, wait, grew, stride / 1e9)
            state.score = RankScore(
                rank=rank, score=score, compute_share=statistics.median(s[1] for s in state.slices),
                peer_compute_share=statistics.median(s[2] for s in state.slices), peer_wait_share=wait,
                peer_growth=grew,
                window_seconds=stride * cfg.window_steps / 1e9, slices=len(state.slices), flagged=state.flagged)
            if event is not None:
                events.append(StragglerEvent(job=job, rank=rank, started=event[0], score=state.score,
                                             evaluations=event[1], seconds=event[1] * stride / 1e9,
                                             policy=cfg.policy))
        return events

    def _learn(self, r: _RankScoring, work: float) -> float:
        """The rank's work per interval in this slice against its level (1.0 while it has too few slices for one);
        an ordinary slice (within `max_peer_growth`) is learned."""
        cfg = self.config
        grew = work / max(statistics.median(r.level), 1e-9) if len(r.level) * 2 >= cfg.window_steps else 1.0
        if grew <= cfg.max_peer_growth:
            r.level.append(work)
            while len(r.level) > cfg.baseline_slices:
                r.level.popleft()
        return grew

    def _judge(self, state: _RankScoring, score: float, wait: float, peer_growth: float,
               slice_s: float) -> tuple[bool, int] | None:
        """Persistence counted in slices and in the job's seconds; a start also needs the peers to lose
        `min_wait_share` of the time waiting while their own work stays within `max_peer_growth` of its level; the
        flag holds `min_flag_s` of agent time. Returns (started, slices that led to it) on a change."""
        cfg = self.config
        if not state.flagged:
            costly = score > cfg.start_score and wait >= cfg.min_wait_share and peer_growth <= cfg.max_peer_growth
            state.above = state.above + 1 if costly else 0
            if state.above >= cfg.persist_steps and state.above * slice_s >= cfg.persist_s:
                state.flagged, state.below, state.flagged_at = True, 0, self.clock()
                return True, state.above
            return None
        state.below = state.below + 1 if score < cfg.clear_score else 0
        if state.below >= cfg.clear_persist_steps and state.below * slice_s >= cfg.clear_s \
                and self.clock() - state.flagged_at >= cfg.min_flag_s:
            state.flagged, state.above = False, 0
            return False, state.below
        return None

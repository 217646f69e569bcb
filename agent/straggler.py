"""Straggler detection: score each rank's compute time against its peers', with persistence and hysteresis.

In synchronous training every rank's step takes as long as the slowest rank's, so step time cannot find
a straggler. What differs is how the step is spent: the straggler computes longer and waits least in
collectives, its peers compute normally and wait for it. Per rank and window of steps:

    compute per step = (step seconds - collective wait seconds) / steps
    score            = compute per step / median compute per step of its peers

1.0 means as fast as a typical peer; a rank slowed down 1.2x scores about 1.2. The median of the peers
(not the fastest) keeps one noisy-fast peer from inflating every score; with two ranks it is the other
rank. Peers are the ranks doing the same work: with pipeline parallelism, the ranks of the same stage
(stages differ in work by design); the caller passes that grouping.

The dual signal gates the score: a rank is "above" only when its score exceeds `start_score` and its
collective wait per step is below its peers' median (it makes others wait rather than waits itself).
That rejects compute that is an artefact of wait estimates: on gloo the wait is estimated from enqueue
times (see trainwarden.runtime.flight_recorder) and overestimates wait of collectives with compute
between them, for all ranks alike; ratios between ranks doing the same work survive that.

Samples are cumulative (steps, step seconds, wait seconds) per rank. A rank's window runs from its newest
sample back to the newest older sample at least `window_steps` steps before it. Wait totals reach the
agent every few seconds while steps arrive continuously, so a sample is kept only when its wait total
changed (when no wait was ever reported, every step change is kept): endpoints then cover the same steps.
A job is evaluated when every scored rank has a new sample; `persist` consecutive evaluations above
`start_score` flag a rank (a start event), `clear_persist` consecutive ones below `clear_score` clear it
(an end event). Defaults catch a 1.2x slowdown in about 3 evaluations after the window fills, while
CPU-scheduling noise of a few percent stays below 1.1.

Policy (`StragglerPolicy`): ``alert`` records and flags; ``exclude`` also records that the node should be
left out of the next rendezvous (the cluster side acts on it).
"""

from __future__ import annotations

import enum
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Mapping

__all__ = ["RankSample", "RankScore", "StragglerConfig", "StragglerDetector", "StragglerEvent",
           "StragglerPolicy"]

_HISTORY = 512
_MIN_COMPUTE_S = 1e-6


class StragglerPolicy(str, enum.Enum):
    ALERT = "alert"
    """Flag the rank, export it, record an incident."""
    EXCLUDE = "exclude"
    """As alert, and record that the node should be excluded at the next restart."""


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    """When a rank counts as a straggler."""

    window_steps: int = 30
    """Steps in the sliding window a score is computed over."""
    start_score: float = 1.1
    """Score above which an evaluation counts towards flagging."""
    persist: int = 3
    """Consecutive evaluations above `start_score` before the rank is flagged."""
    clear_score: float = 1.05
    """Score below which an evaluation counts towards clearing the flag."""
    clear_persist: int = 5
    """Consecutive evaluations below `clear_score` before the flag is cleared."""
    policy: StragglerPolicy = StragglerPolicy.ALERT
    """What a flagged straggler leads to."""

    def __post_init__(self) -> None:
        if self.window_steps < 2:
            raise ValueError(f"window_steps must be at least 2, got {self.window_steps}")
        if not 1.0 < self.clear_score <= self.start_score:
            raise ValueError(f"need 1 < clear_score <= start_score, got clear_score={self.clear_score} "
                             f"start_score={self.start_score}")
        if self.persist < 1 or self.clear_persist < 1:
            raise ValueError(f"persist and clear_persist must be at least 1, got {self.persist}, {self.clear_persist}")
        object.__setattr__(self, "policy", StragglerPolicy(self.policy))


@dataclass(frozen=True)
class RankSample:
    """Cumulative counters of one rank: steps completed, seconds in steps, seconds waiting in collectives."""

    steps: int
    step_seconds: float
    wait_seconds: float


@dataclass(frozen=True, kw_only=True)
class RankScore:
    """A rank's latest score."""

    rank: int
    score: float
    compute_per_step_s: float
    wait_per_step_s: float
    peer_compute_per_step_s: float
    peer_wait_per_step_s: float
    flagged: bool


@dataclass(frozen=True, kw_only=True)
class StragglerEvent:
    """A rank became a straggler (`started`) or stopped being one."""

    job: str
    rank: int
    started: bool
    score: RankScore
    evaluations: int
    """Consecutive evaluations that led to the event."""
    policy: StragglerPolicy


@dataclass
class _Rank:
    samples: deque = field(default_factory=lambda: deque(maxlen=_HISTORY))
    added: int = 0
    evaluated_at: int = 0
    above: int = 0
    below: int = 0
    flagged: bool = False
    score: RankScore | None = None


class StragglerDetector:
    """Scores and flags per job; not thread-safe (one watchdog thread writes, scrapes read `scores()` copies)."""

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config or StragglerConfig()
        self._jobs: dict[str, dict[int, _Rank]] = {}

    def update(self, job: str, samples: Mapping[int, RankSample],
               groups: Mapping[int, Hashable] | None = None) -> list[StragglerEvent]:
        """Feed the job's current counters; returns the start/end events this caused."""
        ranks = self._jobs.setdefault(job, {})
        for rank, sample in samples.items():
            self._add(ranks.setdefault(rank, _Rank()), sample)
        windows = {r: w for r, w in ((r, self._window(ranks[r])) for r in samples) if w is not None}
        if len(windows) < 2 or any(ranks[r].added == ranks[r].evaluated_at for r in windows):
            return []  # evaluate once every scored rank has new data
        for r in windows:
            ranks[r].evaluated_at = ranks[r].added
        groups = groups or {}
        events = []
        for rank, (compute, wait) in sorted(windows.items()):
            peers = [windows[p] for p in windows if p != rank and groups.get(p) == groups.get(rank)]
            if not peers:
                continue
            peer_compute = max(_MIN_COMPUTE_S, statistics.median(c for c, _ in peers))
            peer_wait = statistics.median(w for _, w in peers)
            state = ranks[rank]
            score = compute / peer_compute
            event = self._judge(job, rank, state, score, above=score > self.config.start_score and wait < peer_wait)
            state.score = RankScore(rank=rank, score=score, compute_per_step_s=compute, wait_per_step_s=wait,
                                    peer_compute_per_step_s=peer_compute, peer_wait_per_step_s=peer_wait,
                                    flagged=state.flagged)
            if event is not None:
                events.append(StragglerEvent(job=job, rank=rank, started=event[0], score=state.score,
                                             evaluations=event[1], policy=self.config.policy))
        return events

    def scores(self) -> dict[str, dict[int, RankScore]]:
        """Latest score of every scored rank, per job."""
        return {job: {r: s.score for r, s in sorted(ranks.items()) if s.score is not None}
                for job, ranks in sorted(self._jobs.items())}

    def flagged(self, job: str) -> list[int]:
        return sorted(r for r, s in self._jobs.get(job, {}).items() if s.flagged)

    def forget(self, job: str) -> None:
        self._jobs.pop(job, None)

    def _add(self, state: _Rank, sample: RankSample) -> None:
        history = state.samples
        if history and (sample.steps < history[-1].steps or sample.wait_seconds < history[-1].wait_seconds):
            history.clear()  # counters went back: a new store or a bug upstream; start over
        if history:
            last = history[-1]
            waited = sample.wait_seconds != last.wait_seconds
            never_waited = sample.wait_seconds == 0.0 and sample.steps != last.steps
            if not (waited or never_waited):
                return
        history.append(sample)
        state.added += 1

    def _window(self, state: _Rank) -> tuple[float, float] | None:
        history = state.samples
        if len(history) < 2:
            return None
        newest = history[-1]
        start = None
        for sample in reversed(history):
            if newest.steps - sample.steps >= self.config.window_steps:
                start = sample
                break
        if start is None:
            return None
        while len(history) > 2 and newest.steps - history[1].steps >= self.config.window_steps:
            history.popleft()  # keep one sample beyond the window, no more
        steps = newest.steps - start.steps
        wait = max(0.0, newest.wait_seconds - start.wait_seconds)
        compute = max(_MIN_COMPUTE_S, (newest.step_seconds - start.step_seconds) - wait)
        return compute / steps, wait / steps

    def _judge(self, job: str, rank: int, state: _Rank, score: float, *, above: bool) -> tuple[bool, int] | None:
        cfg = self.config
        if not state.flagged:
            state.above = state.above + 1 if above else 0
            if state.above >= cfg.persist:
                state.flagged, state.below = True, 0
                return True, state.above
            return None
        state.below = state.below + 1 if score < cfg.clear_score else 0
        if state.below >= cfg.clear_persist:
            state.flagged, state.above = False, 0
            return False, state.below
        return None

"""Communication regression: the whole job slower because its collectives are, not because any rank computes more.

A link that drops to a fraction of its bandwidth slows every all-reduce that crosses it, and in synchronous
training every rank waits for those: each step takes longer on every rank alike. No rank stands out, so the
straggler detector (a rank that computes more while its peers wait) says nothing; step time alone cannot tell
it from a job that simply has more to compute. What tells it apart is where the extra time goes:

    step time        up against the job's own recent baseline             (the job is slower)
    collective wait  up on every rank, by most of the step time's increase (the time went to collectives)
    compute          flat on every rank: step time minus collective wait   (no rank has more work)

A straggler fails the third test (its own compute is up); a general slowdown (a throttled CPU, a bigger
batch) fails the second and the third. Input is each rank's cumulative counters at every watchdog check
(`RankTotals`: steps, step seconds, collective wait seconds, the checkpoint stage, the pid): on gloo the
collective wait is the runtime's estimate from Flight Recorder enqueue times (the time from a collective's
enqueue to the thread's next enqueue, or to the step's end), on NCCL the measured durations.

The job's time is cut into windows of at least `window_s` seconds in which every rank completed at least
`min_window_steps` steps. A window is *tainted*, and neither judged nor learned from, when a rank was restoring
a checkpoint or held for a membership change during it, or when it began before `warmup_steps` steps of the current
worker round (a new set of pids: a restart, a join), or before `warmup_s` seconds after its first step, whichever
comes first. The baseline is the median of the last `baseline_windows` healthy windows, per rank;
each world size keeps its own (a job that shrank and grew back judges with its old size's at once). A window is
*suspect* when the job's median step time is at least `start_ratio` times the baseline's and every rank's
collective wait grew by at least `min_comm_share` of its step time's growth while its compute stayed within
`max_compute_ratio` of its baseline's. The latest `persist_windows` slow windows in a row are judged pooled (their
counters summed): on gloo a step's wait reaches the agent with the next Flight Recorder read, so one short window can
hold a step without its wait and the next two steps' worth. `persist_windows` slow windows in a row that are suspect
pooled start a regression;
`clear_windows` windows in a row at most `clear_ratio` times the baseline end it. Suspect and regressed
windows never enter the baseline, so a regression that lasts does not become the new normal.

Not thread-safe: the watchdog's thread feeds it.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

__all__ = ["CommRegressionConfig", "CommRegressionDetector", "CommRegressionEvent", "RankTotals", "WindowStats"]

_NOT_TRAINING = frozenset({"restore_start", "held"})
"""Checkpoint stages during which a window says nothing about the links: a restore, a hold for a membership
change. Saves do not taint a window: they recur in the baseline as in every later window, and a save that
blocks longer adds to compute, not to collective wait, so it is never suspect (a job checkpointing every 5
steps had no untainted window when saves tainted them: tests/fixtures/comm_regression/gpt_link)."""


@dataclass(frozen=True, kw_only=True)
class CommRegressionConfig:
    """When a job's slowdown counts as a communication regression."""

    window_s: float = 5.0
    """Shortest window of the job's time (agent clock). With ``persist_windows`` 2, a regression starts 2-3 windows
    after the fault: 10 s windows took 39 s on the recorded reference job's slow link (gpt_link), 5 s windows of
    at least 3 steps 11-17 s on every recorded fault, and neither flagged the recorded healthy or straggler jobs
    (issue 47: a 3x regression named within 30 s)."""
    min_window_steps: int = 3
    """Steps every rank completes in a window: slow jobs get longer windows. A window whose steps are already
    ``start_ratio`` times the baseline's closes after one step on every rank (``_slow_already``)."""
    warmup_steps: int = 20
    """Steps of a new worker round before its windows count (start-up, a restore's first steps)..."""
    warmup_s: float = 10.0
    """...or this long after every rank's first step of the round, with at least ``min_window_steps`` steps done:
    a job of slow steps is not blind for 20 of them after every restart. In the soak's hour a link degraded 6 s
    after n1 rejoined, its steps went from 0.3 s to 3.5 s, and the 20 warm-up steps took 37 s: named 51.5 s after
    the fault, where the others were named in 9-12 s (issue 47)."""
    baseline_windows: int = 6
    """Healthy windows the baseline is the median of."""
    start_ratio: float = 1.5
    """Job step time / baseline at or above which a window can be suspect."""
    clear_ratio: float = 1.2
    """Job step time / baseline at or below which a window counts towards the end of a regression."""
    min_comm_share: float = 0.6
    """On every rank, collective wait growth / step time growth at least this."""
    max_compute_ratio: float = 1.3
    """On every rank, compute per step / baseline compute at most this."""
    flat_compute_share: float = 0.25
    """A rank's compute also counts as flat at or below this share of its window's step time. On an oversubscribed
    CPU the gloo wait estimate can take the whole healthy step (baseline compute 0); then only a window whose
    estimate also took it all passed, and a 6x slow link on the bed (4 ranks on 2 busy cores) started a regression
    after 20 slow steps instead of 2 windows (issue 47). A straggler's own compute is most of its step."""
    persist_windows: int = 2
    """Suspect windows in a row that start a regression."""
    clear_windows: int = 2
    """Windows in a row at or below `clear_ratio` that end it."""
    near_windows: int = 6
    """Slow windows in a row during which a start may be near (`CommRegressionDetector.near_decision`): a degraded
    link started within 3 on the bed (issue 47); a job that stays slower for another reason (a throttled CPU: the
    baseline does not follow it) is not near a decision for ever."""

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.min_window_steps < 1 or self.baseline_windows < 1:
            raise ValueError("window_s must be > 0, min_window_steps and baseline_windows at least 1")
        if not 1.0 <= self.clear_ratio < self.start_ratio:
            raise ValueError(f"need 1 <= clear_ratio < start_ratio, got {self.clear_ratio}, {self.start_ratio}")
        if not 0.0 < self.min_comm_share <= 1.0:
            raise ValueError(f"min_comm_share must be in (0, 1], got {self.min_comm_share}")
        if not 0.0 <= self.flat_compute_share < 1.0:
            raise ValueError(f"flat_compute_share must be in [0, 1), got {self.flat_compute_share}")
        if self.max_compute_ratio < 1.0:
            raise ValueError(f"max_compute_ratio must be at least 1, got {self.max_compute_ratio}")
        if self.persist_windows < 1 or self.clear_windows < 1 or self.warmup_steps < 0 or self.warmup_s < 0:
            raise ValueError("persist_windows and clear_windows must be at least 1, warmup_steps and warmup_s 0 or "
                             "more")
        if self.near_windows < 0:
            raise ValueError(f"near_windows must be 0 (never near) or more, got {self.near_windows}")


@dataclass(frozen=True, kw_only=True)
class RankTotals:
    """A rank's cumulative counters at one check (agent counters: monotonic across its worker restarts)."""

    steps: int
    step_seconds: float
    wait_seconds: float
    """Collective wait (measured, or the runtime's estimate on gloo)."""
    stage: str = ""
    """The checkpoint stage it is in ("" when none)."""
    pid: int = 0


@dataclass(frozen=True, kw_only=True)
class WindowStats:
    """Per-step averages of one rank over a window."""

    step_s: float
    wait_s: float
    steps: int = 1
    """Steps the averages are over (what pooling windows weighs them by)."""

    @property
    def compute_s(self) -> float:
        return max(0.0, self.step_s - self.wait_s)


@dataclass(frozen=True, kw_only=True)
class CommRegressionEvent:
    """A regression started (`started`) or ended, with the evidence."""

    job: str
    started: bool
    ratio: float
    """Job step time / baseline, in the window that decided."""
    baseline_step_s: float
    step_s: float
    baseline: Mapping[int, WindowStats]
    window: Mapping[int, WindowStats]
    windows: int
    """Windows in a row that decided it."""


@dataclass
class _Job:
    round_id: frozenset = frozenset()
    world: int = 0
    round_start_steps: dict[int, int] = field(default_factory=dict)
    first_step_t: float | None = None  # when every rank had finished its first step of the round
    start_t: float = 0.0
    start: dict[int, RankTotals] = field(default_factory=dict)
    tainted: bool = False
    healthy: deque = field(default_factory=deque)  # of {rank: WindowStats}: the current world size's baseline
    baselines: dict[int, deque] = field(default_factory=dict)  # world size -> its healthy windows
    suspect: int = 0
    slow_run: deque = field(default_factory=deque)  # of {rank: WindowStats}: the latest slow windows in a row
    slow_windows: int = 0  # how many windows in a row were slow
    calm: int = 0
    regressed: bool = False
    last: dict | None = None  # the latest closed window's verdict, for status and metrics
    slow_off_links: bool = False  # the latest judged window of this worker round was slow and not suspect


def _pool(windows) -> dict[int, WindowStats]:
    """Consecutive windows as one, per rank (weighted by their steps)."""
    pooled = {}
    for rank in windows[-1]:
        mine = [w[rank] for w in windows if rank in w]
        steps = sum(w.steps for w in mine)
        pooled[rank] = WindowStats(step_s=sum(w.step_s * w.steps for w in mine) / steps,
                                   wait_s=sum(w.wait_s * w.steps for w in mine) / steps, steps=steps)
    return pooled


class CommRegressionDetector:
    """Feeds on every check's `RankTotals` per job; returns start and end events."""

    def __init__(self, config: CommRegressionConfig | None = None) -> None:
        self.config = config or CommRegressionConfig()
        self._jobs: dict[str, _Job] = {}

    def regressed(self, job: str) -> bool:
        state = self._jobs.get(job)
        return bool(state and state.regressed)

    def links_suspect(self, job: str) -> bool:
        """Whether `job` is in a regression or its latest judged window was suspect: a rank that looks busier than
        its peers now may only be waiting for collectives later than it enqueued them (a straggler's question)."""
        state = self._jobs.get(job)
        return bool(state and (state.regressed or (state.last or {}).get("suspect")))

    def near_decision(self, job: str) -> bool:
        """True while a regression of `job` may be about to start: its latest judged windows were slow (at least
        ``start_ratio`` times the baseline, suspect or not yet: on gloo their wait comes with the next Flight
        Recorder read), no more than ``near_windows`` of them in a row, and none has started. The agent asks for
        the workers' reads at their own pace then, not the quiet one (agent/watchdog/read_pace.py): what decides a
        start is the wait those reads carry. An end is decided on step time alone."""
        state = self._jobs.get(job)
        return bool(state and not state.regressed and 0 < state.slow_windows <= self.config.near_windows)

    def last_window(self, job: str) -> dict | None:
        """The latest judged window of `job`: ratio, baseline and current step time, whether suspect."""
        state = self._jobs.get(job)
        return dict(state.last) if state and state.last else None

    def forget(self, job: str) -> None:
        self._jobs.pop(job, None)

    def slow_off_links(self, job: str) -> bool:
        """Whether ``job``'s latest judged window here was slow (at least ``start_ratio`` times the baseline) without
        being a communication regression's: some rank's own compute grew, or its wait did not. On a job of several
        nodes, the other nodes hold their starts while one says so (``update``'s ``elsewhere``)."""
        state = self._jobs.get(job)
        return bool(state and state.slow_off_links)

    def update(self, job: str, t: float, totals: Mapping[int, RankTotals], *, straggler: bool = False,
               elsewhere: Callable[[], Sequence[str]] | None = None) -> list[CommRegressionEvent]:
        """The events of ``job``'s latest counters. ``straggler``: a rank of the job is flagged a straggler now;
        no regression starts while it is (its peers wait for it in collectives, which looks like a slower network:
        soak run D's false alarm during a slow rank), the mirror of the straggler detector's ``links_suspect``.
        The windows still count, so a regression that outlasts the straggler starts with the next window.

        ``elsewhere()``: the job's other nodes whose latest window was slow off the links (``slow_off_links``),
        asked only when a start is due; no regression starts while there is one. This node sees only its own
        ranks: a rank that computes more on another node makes every rank here wait in collectives, which is a
        slower network by every measure this node has (the daemon soak's slow rank 1 on n0, a false regression on
        n1 two windows after the slowdown, 50 s before n0 named the straggler)."""
        if not totals:
            return []
        cfg = self.config
        state = self._jobs.setdefault(job, _Job(healthy=deque(maxlen=cfg.baseline_windows)))
        round_id = frozenset((rank, r.pid) for rank, r in totals.items())
        if round_id != state.round_id:  # a new worker round: warm up again; each world size its own baseline
            if len(totals) != state.world:  # a job that shrank and grew back judges with its old size's at once
                state.healthy = state.baselines.setdefault(len(totals), deque(maxlen=cfg.baseline_windows))
            state.round_id, state.world = round_id, len(totals)
            state.round_start_steps = {rank: r.steps for rank, r in totals.items()}
            state.first_step_t = None
            self._open(state, t, totals)
            state.suspect = state.calm = state.slow_windows = 0
            state.slow_off_links = False  # a window of the last round says nothing of this one's
            state.slow_run.clear()
            return []
        if any(r.stage in _NOT_TRAINING for r in totals.values()):
            state.tainted = True
        if state.first_step_t is None and all(r.steps > state.round_start_steps.get(rank, 0)
                                              for rank, r in totals.items()):
            state.first_step_t = t
        done = {rank: r.steps - state.start[rank].steps for rank, r in totals.items() if rank in state.start}
        if len(done) != len(totals) or t - state.start_t < cfg.window_s:
            return []
        if min(done.values()) < cfg.min_window_steps and not self._slow_already(state, totals, done):
            return []
        window = {rank: WindowStats(step_s=(r.step_seconds - state.start[rank].step_seconds) / done[rank],
                                    wait_s=max(0.0, r.wait_seconds - state.start[rank].wait_seconds) / done[rank],
                                    steps=done[rank])
                  for rank, r in totals.items()}
        into = [state.start[rank].steps - state.round_start_steps.get(rank, 0) for rank in totals]
        warm = min(into) >= cfg.warmup_steps or (
            min(into) >= cfg.min_window_steps and state.first_step_t is not None
            and state.start_t - state.first_step_t >= cfg.warmup_s)
        tainted = state.tainted or not warm
        self._open(state, t, totals)
        if tainted:
            return []
        return self._judge(job, state, window, straggler=straggler, elsewhere=elsewhere)

    def _slow_already(self, state: _Job, totals: Mapping[int, RankTotals], done: dict[int, int]) -> bool:
        """Whether a window of fewer than ``min_window_steps`` steps (at least one on every rank) may close: its steps
        are already ``start_ratio`` times the baseline's. A job slowed to seconds a step is then judged every step
        or two instead of every three: at 9 s a step, windows of 3 steps named a degraded link on the bed 93 s
        after the fault (issue 47: within 30 s). A healthy job's windows keep their steps."""
        if min(done.values()) < 1 or len(state.healthy) < self.config.baseline_windows:
            return False
        step = statistics.median((r.step_seconds - state.start[rank].step_seconds) / done[rank]
                                 for rank, r in totals.items())
        base = statistics.median(statistics.median(w[rank].step_s for w in state.healthy if rank in w)
                                 for rank in totals if any(rank in w for w in state.healthy))
        return base > 0 and step >= self.config.start_ratio * base

    @staticmethod
    def _open(state: _Job, t: float, totals: Mapping[int, RankTotals]) -> None:
        state.start_t, state.start, state.tainted = t, dict(totals), False

    def _judge(self, job: str, state: _Job, window: dict[int, WindowStats], *, straggler: bool = False,
               elsewhere: Callable[[], Sequence[str]] | None = None) -> list[CommRegressionEvent]:
        cfg = self.config
        if len(state.healthy) < cfg.baseline_windows:
            state.healthy.append(window)  # still learning what normal is
            return []
        baseline = {rank: WindowStats(step_s=statistics.median(w[rank].step_s for w in state.healthy if rank in w),
                                      wait_s=statistics.median(w[rank].wait_s for w in state.healthy if rank in w))
                    for rank in window if all(rank in w for w in state.healthy)}
        if len(baseline) != len(window):  # ranks the baseline does not know: learn again
            state.healthy.clear()
            state.healthy.append(window)
            return []
        base_step = statistics.median(b.step_s for b in baseline.values())
        step = statistics.median(w.step_s for w in window.values())
        ratio = step / base_step if base_step > 0 else 1.0
        suspect = False
        if ratio >= cfg.start_ratio:
            state.slow_windows += 1
            state.slow_run.append(window)
            while len(state.slow_run) > cfg.persist_windows:
                state.slow_run.popleft()
            pooled = window = _pool(state.slow_run)  # what decides, and the start event's evidence
            suspect = all(self._comm_bound(pooled[r], baseline[r]) for r in window)
        else:
            state.slow_windows = 0
            state.slow_run.clear()
        state.last = {"ratio": round(ratio, 3), "baseline_step_s": base_step, "step_s": step, "suspect": suspect,
                      "straggler": straggler}
        state.slow_off_links = ratio >= cfg.start_ratio and not suspect
        events = []
        if suspect:
            state.suspect = max(state.suspect + 1, len(state.slow_run))
            state.calm = 0
            due = not state.regressed and state.suspect >= cfg.persist_windows and not straggler
            held_by = list(elsewhere() or ()) if due and elsewhere is not None else []
            if held_by:
                state.last["held_by"] = held_by
            elif due:
                state.regressed = True
                events.append(CommRegressionEvent(job=job, started=True, ratio=ratio, baseline_step_s=base_step,
                                                  step_s=step, baseline=baseline, window=window,
                                                  windows=state.suspect))
            return events
        state.suspect = 0
        if ratio <= cfg.clear_ratio:
            state.calm += 1
            if state.regressed:
                if state.calm >= cfg.clear_windows:
                    state.regressed = False
                    events.append(CommRegressionEvent(job=job, started=False, ratio=ratio, baseline_step_s=base_step,
                                                      step_s=step, baseline=baseline, window=window,
                                                      windows=state.calm))
            else:
                state.healthy.append(window)  # a normal window: the baseline follows slow drift
        else:
            state.calm = 0
        return events

    def _comm_bound(self, now: WindowStats, base: WindowStats) -> bool:
        """This rank's extra time went to collectives, not to its own work."""
        grown = now.step_s - base.step_s
        if grown <= 0:
            return False
        cfg = self.config
        compute_ok = now.compute_s <= max(cfg.max_compute_ratio * max(base.compute_s, 1e-6),
                                          cfg.flat_compute_share * now.step_s)
        return compute_ok and (now.wait_s - base.wait_s) >= self.config.min_comm_share * grown

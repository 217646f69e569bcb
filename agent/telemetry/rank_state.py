"""The store's mutable state per rank and per job, and the snapshots made of it.

`RankState` holds one rank's counters and recent windows (agent/telemetry/job_telemetry.py's module docstring says
how they are kept); `JobRanks` holds a job's ranks and what is the job's (checkpoint and numeric counts, the uid that
owns it, the arrival matcher). `job_snapshot` and `rank_snapshot` turn them into the frozen snapshots readers get
(agent/telemetry/snapshots.py): percentiles, throughput and wait share over the recent windows, and the steady and
writing step times the hang deadline follows. The store's lock guards all of it; nothing here locks.
"""

from __future__ import annotations

from collections import deque

from trainwarden.agent.shared.contract import FLUSH_INTERVAL_S
from trainwarden.agent.telemetry.arrivals import ArrivalMatcher, Interval
from trainwarden.agent.telemetry.snapshots import CollectiveTotals, JobSnapshot, RankSnapshot, WorkerInfo

__all__ = ["COLLECTIVE_GAPS_KEPT", "STARTUP_STEPS", "STEPS_AFTER_WRITE", "STEP_BUCKETS", "WRITE_BEGINS", "WRITE_ENDS",
           "JobRanks", "RankState", "job_snapshot", "rank_snapshot"]

# Step-duration histogram buckets (seconds): from fast CPU test steps to multi-minute pipeline steps.
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
STARTUP_STEPS = 3
"""A worker process's first steps, left out of its steady step time (`RankSnapshot.steady_step_p99_seconds`)."""
COLLECTIVE_GAPS_KEPT = 512
"""Gaps between a rank's consecutive collectives kept for `RankSnapshot.collective_gap_max_seconds`."""
WRITE_BEGINS = frozenset({"save_start", "staged"})
WRITE_ENDS = frozenset({"written", "committed", "failed"})
"""Checkpoint stages that begin and end a rank's write (`RankSnapshot.writing_step_p99_seconds`). A runtime that
never reports ``written`` (older than the stage) leaves every rank but the committing one writing: all their steps
count as writing, and the deadline follows them all, as it did before."""
STEPS_AFTER_WRITE = 1
"""Steps after the one in which the job's writes here ended that still count as writing: rank 0 commits, runs its
retention and the agent publishes the commit in that one (a new worker process's first commit slowed it 2-3x on the
reference job, 0.36-0.61 s against 0.2 s: `tests/bench/bench_hang.py`'s logs, issue 26)."""


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[index]


class RankState:
    """One rank's mutable state in the store: its counters, windows and marks (the store's lock guards it)."""

    def __init__(self, info: WorkerInfo, recent_steps: int, now: float) -> None:
        self.info = info
        self.restarts = 0  # new worker processes seen for this rank
        self.streams = 1  # streams opened for this rank (Hellos), reconnects of the same process included
        self.connected = True
        self.last_seen = now
        self.stream_since = now  # (clock) when its current stream said Hello
        self.ended_at = 0.0  # (clock) when its last stream ended; 0 while connected
        self.last_step = -1
        self.step_count = 0
        self.step_seconds_total = 0.0
        self.bucket_counts = [0] * (len(STEP_BUCKETS) + 1)
        self.tokens_total = 0
        self.recent = deque(maxlen=recent_steps)  # (start_unix, duration, tokens)
        self.process_steps = 0  # steps the current worker process reported
        self.steady = deque(maxlen=recent_steps)  # durations of its steps after the first STARTUP_STEPS
        self.writing_steps = deque(maxlen=recent_steps)  # those of them that overlapped a checkpoint write
        self.write_started = -1  # the newest step whose save this worker process began (save_start, staged)
        self.write_ended = -1  # the newest step whose write ended here (written, committed, failed)
        self.write_mark = 0  # the job's `write_events` as of this worker's last step
        self.write_tail = 0  # steps still to count as writing after the job's writes here ended
        self.wait_by_op: dict[str, float] = {}
        self.collectives: dict[tuple[str, str], CollectiveTotals] = {}
        self.prev_cumulative: dict[tuple[str, str], tuple[int, float]] = {}
        self.has_durations = False
        self.wait_total = 0.0
        self.compute_total = 0.0
        self.share_window = deque(maxlen=16)  # (step_seconds_total, wait_total)
        self.last_step_end_ns = 0
        self.interval_mark: tuple[float, float] | None = None  # (step_seconds_total, compute_total)
        self.checkpoint_stall = 0.0
        self.checkpoint_stage = ""  # the last stage reported ("" for none); a new worker starts afresh
        self.dropped_total = 0
        self.prev_dropped = 0
        self.flags: set[str] = set()
        self.goodbye: str | None = None  # the reason the worker gave before its stream ended, if it did
        self.straggler_score = 0.0  # the watchdog's latest score (0: not scored)
        self.collectives_seen = 0
        self.last_collective_ns = 0
        self.collective_gaps: deque[int] = deque(maxlen=COLLECTIVE_GAPS_KEPT)  # ns, of the current process
        self.prev_arrival_ns = 0  # the last arrival of an unbroken stretch (0: none)
        self.still_since = None  # (clock) since when the training thread has not moved; None: it moves
        self.pending_since = None  # (clock) since when its oldest collective has been in flight, while still
        self.promise_until = 0.0  # (clock) until when its last batch's promise of the next holds (0: none)
        self.promised_by = 0.0  # (clock) when the batch it promised is due
        self.steps_stopped = False  # a batch promising nothing came after one that promised

    def update_compute(self) -> None:
        self.compute_total = max(self.compute_total, self.step_seconds_total - self.wait_total)

    def new_process(self) -> None:
        """A new worker process holds the rank (a restart): what belonged to the old one starts afresh; the agent's
        counters go on."""
        self.interval_mark = None
        self.restarts += 1
        self.prev_cumulative.clear()
        self.goodbye = None
        self.prev_dropped = 0
        self.recent.clear()
        self.process_steps = 0
        self.steady.clear()
        self.writing_steps.clear()
        self.write_started = self.write_ended = -1
        self.write_tail = 0  # the old process's write ended with it
        self.checkpoint_stage = ""
        self.collective_gaps.clear()
        self.prev_arrival_ns = 0
        self.still_since = self.pending_since = None
        self.new_stream()

    def new_stream(self) -> None:
        """A new stream (a new process, or the same one reconnected) has promised nothing and stopped nothing."""
        self.promise_until, self.steps_stopped = 0.0, False

    def promise(self, within_s: float, now: float) -> None:
        """A batch of steps arrived promising the next within `within_s` (0: nothing). The promise is held for
        twice that: a sender late by a scheduling hiccup must not look like a stall."""
        if within_s > 0:
            self.promise_until, self.promised_by, self.steps_stopped = now + 2 * within_s, now + within_s, False
        elif self.promise_until > 0:
            self.promise_until, self.steps_stopped = 0.0, True


class JobRanks:
    """One job's mutable state in the store: its ranks, checkpoint and numeric counts, owner and arrival matcher."""

    def __init__(self, info: WorkerInfo) -> None:
        self.world_size = info.world_size
        self.mesh = dict(info.mesh)
        self.ranks: dict[int, RankState] = {}
        self.restarts_seen = 0
        self.checkpoint_last_step = -1
        self.checkpoint_failures = 0
        self.checkpoint_committed_unix = 0.0
        self.checkpoint_set_aside = 0
        self.numeric_events: dict[str, int] = {}
        self.owner_uid: int | None = None  # the uid of the job's first verified stream (module docstring)
        self.matcher = ArrivalMatcher()
        self.write_events = 0  # writes begun or ended on the ranks here: a step that saw one overlapped it
        self.intervals: dict[int, list[Interval]] = {}  # from measured durations

    def write_overlaps(self, rank: RankState) -> bool:
        """Whether `rank`'s step in flight overlaps a checkpoint write: one runs on a rank here (a save begun at a
        newer step than its write last ended), or one began or ended since the rank's last step."""
        return (rank.write_mark != self.write_events
                or any(r.write_started > r.write_ended for r in self.ranks.values()))


def job_snapshot(name: str, job: JobRanks, now: float) -> JobSnapshot:
    """The job's state at `now` (taken under the store's lock)."""
    return JobSnapshot(
        job=name, world_size=job.world_size, mesh=dict(job.mesh),
        ranks=tuple(rank_snapshot(r, now, job) for _, r in sorted(job.ranks.items())),
        restarts_total=job.restarts_seen, checkpoint_last_step=job.checkpoint_last_step,
        checkpoint_failures_total=job.checkpoint_failures,
        checkpoint_committed_unix=job.checkpoint_committed_unix, checkpoint_set_aside_total=job.checkpoint_set_aside,
        numeric_events=tuple(sorted(job.numeric_events.items())),
    )


def rank_snapshot(r: RankState, now: float, job: JobRanks) -> RankSnapshot:
    """The rank's state at `now`: percentiles over its recent steps, its throughput and wait share, its flags."""
    durations = sorted(d for _, d, _ in r.recent)
    tokens_per_second = 0.0
    if len(r.recent) >= 2:
        first, last = r.recent[0], r.recent[-1]
        span = last[0] + last[1] - first[0]
        if span > 0:
            tokens_per_second = sum(t for _, _, t in r.recent) / span
    wait_share = 0.0
    if r.share_window:
        (s0, w0), (s1, w1) = r.share_window[0], r.share_window[-1]
        if len(r.share_window) == 1 or s1 <= s0:
            s0 = w0 = 0.0
        if s1 > s0:
            wait_share = min(1.0, max(0.0, (w1 - w0) / (s1 - s0)))
    flags = set(r.flags)
    if not r.connected:
        flags.add("disconnected")
    return RankSnapshot(
        rank=r.info.rank, local_rank=r.info.local_rank, pid=r.info.pid, hostname=r.info.hostname,
        verified=r.info.verified, started=r.info.started,
        connected=r.connected, restart_count=r.info.restart_count, last_step=r.last_step,
        last_seen_monotonic=r.last_seen, step_count=r.step_count, step_seconds_total=r.step_seconds_total,
        step_bucket_counts=tuple(r.bucket_counts), tokens_total=r.tokens_total,
        compute_seconds_total=r.compute_total, wait_seconds_by_op=dict(r.wait_by_op),
        collectives=tuple(v for _, v in sorted(r.collectives.items())),
        collective_has_durations=r.has_durations, checkpoint_stall_seconds=r.checkpoint_stall,
        checkpoint_stage=r.checkpoint_stage,
        step_p50_seconds=_percentile(durations, 0.5), step_p99_seconds=_percentile(durations, 0.99),
        wait_share=wait_share, tokens_per_second=tokens_per_second, dropped_total=r.dropped_total,
        flags=tuple(sorted(flags)), straggler_score=r.straggler_score, last_step_end_unix=r.last_step_end_ns / 1e9,
        streams=r.streams, step_source=r.info.step_source, collectives_seen=r.collectives_seen,
        last_collective_unix=r.last_collective_ns / 1e9, gpu_uuid=r.info.gpu_uuid,
        collective_gap_max_seconds=max(r.collective_gaps, default=0) / 1e9,
        # until a few steady steps are in, all of them: a job whose every step is long must not be
        # held to the floor deadline by an empty window
        steady_step_p99_seconds=(_percentile(sorted(r.steady), 0.99) if len(r.steady) >= STARTUP_STEPS
                                 else _percentile(durations, 0.99)),
        steady_steps=len(r.steady),
        writing_step_p99_seconds=_percentile(sorted(r.writing_steps), 0.99),
        write_pending=r.write_tail > 0 or job.write_overlaps(r),
        still_seconds=0.0 if r.still_since is None else max(0.0, now - r.still_since),
        collective_pending_seconds=0.0 if r.pending_since is None else max(0.0, now - r.pending_since),
        steps_promised=r.promise_until > now, steps_stopped=r.steps_stopped,
        steps_overdue=r.promised_by + FLUSH_INTERVAL_S < now < r.promise_until,
    )

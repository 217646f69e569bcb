"""Per-job, per-rank state aggregated from worker telemetry.

The telemetry server feeds this store from every worker stream on the node; the job metrics collector,
the `Status` RPC and the watchdog read it. It knows nothing about gRPC or protobuf: the server converts
messages into the plain calls below, so tests and other readers can drive it directly.

Design:

- One lock guards everything. Writers hold it for a few dictionary updates; readers take a `snapshot()`
  of frozen dataclasses and work on that, so a slow scrape never blocks ingestion for long.
- Counters exported to Prometheus (steps, tokens, collective wait, compute) are the agent's own and only
  ever grow. Workers send cumulative collective totals per process; the store turns them into deltas per
  worker process (a new pid starts from zero), so a worker restart or a repeated message neither loses nor
  double counts anything.
- Windows (step-time percentiles, wait share, throughput) use the last `recent_steps` steps, so `top`
  reflects the job now, not its whole history.
- Compute seconds = step seconds − collective wait seconds. Waits arrive after the steps they belong to
  (the runtime reads the Flight Recorder every few seconds), so compute advances only when a collectives
  record arrives: it covers the steps sent before it (the runtime sends one, possibly empty, every
  interval). It is kept monotonic so that Prometheus never sees a counter reset.
- Straggler intervals (`take_intervals`): on gloo, from collective arrivals matched across the node's
  ranks (agent/telemetry/arrivals.py); where the recorder measures durations (NCCL with timing), one interval per
  collectives record, from the step and wait counters. Only the watchdog takes them.
- A rank's identity is (job, rank). Jobs whose ranks have all been disconnected for a while are dropped by
  `prune()`, which keeps the label sets of the exported metrics bounded.
- A job belongs to a uid: the kernel's uid (``WorkerInfo.uid``, peer credentials) of its first verified stream.
  ``connect`` refuses a stream of another uid for any rank of the job, and an unverified stream once the job has
  a verified owner, until ``prune()`` forgets the job: a rank between two streams (a restart, a reconnect) is not
  up for grabs.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping, Protocol

from trainwarden.agent.shared.contract import CHECKPOINT_STAGES, NUMERIC_KINDS
from trainwarden.agent.telemetry.arrivals import Arrival, ArrivalMatcher, Interval

log = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINT_STAGES",
    "REJECT_REASONS",
    "STEP_BUCKETS",
    "CollectiveTotals",
    "JobSnapshot",
    "JobTelemetry",
    "TelemetryListener",
    "RankSnapshot",
    "WorkerInfo",
]

# Step-duration histogram buckets (seconds): from fast CPU test steps to multi-minute pipeline steps.
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Bounded `reason` label values for trainwarden_telemetry_rejected_total.
REJECT_REASONS = ("malformed", "oversized", "no_hello", "invalid", "unverified", "identity", "limit")
"""``unverified``: a Hello or Commit without peer credentials where they are required; ``identity``: a stream or
Commit refused for who the kernel says it is (another uid than the job's, not the rank's stream)."""
MAX_COLLECTIVE_KEYS = 64
"""(process group, op) pairs kept per rank; a worker naming more is counted, not stored (bounded labels)."""
MAX_OPS = 32
"""Distinct op label values per rank; more fold into "other"."""
OVERFLOW_KINDS = ("collective_keys", "ops")


@dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    """What a worker says about itself in its Hello."""

    job: str
    """Job name (bounded label)."""
    rank: int
    """Global rank."""
    local_rank: int = 0
    """Rank on this node."""
    world_size: int = 1
    """Number of ranks in the job."""
    mesh: Mapping[str, int] = field(default_factory=dict)
    """Parallelism shape, e.g. {"pp": 2, "tp": 2, "dp": 2}."""
    pid: int = 0
    """Worker process id."""
    restart_count: int = 0
    """torchrun's restart count when the worker started."""
    hostname: str = ""
    """Host the worker runs on."""
    verified: bool = False
    """`pid` is the kernel's (peer credentials), not the worker's claim: only then may the agent signal it."""
    started: float = 0.0
    """The process's start time when it was verified (a reused pid has another)."""
    step_source: str = ""
    """Where its steps come from: "rt.step" or "optimizer hooks" (contract.STEP_SOURCES); "" from older runtimes."""
    uid: int | None = None
    """The process's uid from the kernel when `verified`; None for an unverified stream."""
    gpu_uuid: str = ""
    """The worker's CUDA device as NVML names it ("GPU-..."); "" until its first CUDA step, or without CUDA."""


@dataclass(frozen=True, kw_only=True)
class CollectiveTotals:
    """Collective totals for one (process group, op)."""

    process_group: str
    """Process group name or id."""
    op: str
    """Collective name, e.g. "all_reduce"."""
    count: int
    """Collectives seen."""
    wait_seconds: float
    """Seconds spent in (or estimated waiting for) them."""
    last_seq_id: int
    """Highest collective sequence id seen in the group."""


@dataclass(frozen=True, kw_only=True)
class RankSnapshot:
    """A rank's state at one instant (agent counters are monotonic across worker restarts)."""

    rank: int
    local_rank: int
    pid: int
    hostname: str
    connected: bool
    restart_count: int
    last_step: int
    last_seen_monotonic: float
    step_count: int
    step_seconds_total: float
    step_bucket_counts: tuple[int, ...]
    tokens_total: int
    compute_seconds_total: float
    wait_seconds_by_op: Mapping[str, float]
    collectives: tuple[CollectiveTotals, ...]
    collective_has_durations: bool
    checkpoint_stall_seconds: float
    checkpoint_stage: str
    step_p50_seconds: float
    step_p99_seconds: float
    wait_share: float
    tokens_per_second: float
    dropped_total: int
    flags: tuple[str, ...]
    straggler_score: float = 0.0
    steady_step_p99_seconds: float = 0.0
    """p99 of the steps this worker process took after its first `STARTUP_STEPS` (of all its recent steps
    until `STARTUP_STEPS` more are in): what the hang deadline follows. Start-up steps (allocation,
    compilation, a restore's first batch) run under the start-up deadline and would otherwise stretch the
    steady one for as long as they stay in the window."""
    steady_steps: int = 0
    """Steps in that steady window (its first `STARTUP_STEPS` steps left out): under `STARTUP_STEPS`,
    `steady_step_p99_seconds` still holds the start-up steps."""
    writing_step_p99_seconds: float = 0.0
    """p99 of this worker's recent steps that overlapped a checkpoint write of the job's ranks here (from a save's
    ``save_start`` to its ``written``, the step in which it ended and `STEPS_AFTER_WRITE` more): kept out of the
    steady window, because a write sharing the host's cores and disk slows them (2-3x the reference job's steps
    on 2 cores) and one such step would set the deadline of every hang for as long as it stays in the window."""
    write_pending: bool = False
    """The step this worker is in may be slowed by a checkpoint write: one is in flight on a rank of the job here,
    one began or ended since this worker's last step, or it is within `STEPS_AFTER_WRITE` of one. The hang
    deadline then follows the writing steps too."""
    verified: bool = False
    """The pid is the kernel's (see WorkerInfo.verified)."""
    started: float = 0.0
    """The process's start time when verified."""
    last_step_end_unix: float = 0.0
    """Wall time the newest reported step ended (its own timestamp; 0: none yet)."""
    streams: int = 0
    """Streams opened for this rank so far (a reconnect of the same process counts: what the agent told
    the old stream, the new one does not know)."""
    step_source: str = ""
    """Where the rank's steps come from (WorkerInfo.step_source)."""
    collectives_seen: int = 0
    """Collectives the rank reported entering (arrivals) or completing (measured totals): monotonic. Their
    growth is progress too: the hang detector's heartbeat for a loop without steps."""
    last_collective_unix: float = 0.0
    """Wall time the newest reported collective was entered (its own timestamp; 0: none or unknown)."""
    gpu_uuid: str = ""
    """The rank's GPU (WorkerInfo.gpu_uuid): a GPU fault names the ranks on it (`JobTelemetry.ranks_on_gpus`)."""
    collective_gap_max_seconds: float = 0.0
    """The longest time between two consecutive collectives of the rank's current process, over its recent
    collectives (0: fewer than two seen): how long such a loop may go quiet."""
    still_seconds: float = 0.0
    """How long the rank's training thread has stayed inside one call, as of this snapshot (0: it moves, or
    the worker never said): from its TrainingThread reports, aged since the last one."""
    collective_pending_seconds: float = 0.0
    """How long the oldest collective of that training thread has been in flight, as of this snapshot (0: none,
    or the thread moves). Still, with a collective in flight, the rank waits: its own CPU is not work."""


@dataclass(frozen=True, kw_only=True)
class JobSnapshot:
    """A job's state at one instant."""

    job: str
    world_size: int
    mesh: Mapping[str, int]
    ranks: tuple[RankSnapshot, ...]
    restarts_total: int
    checkpoint_last_step: int
    checkpoint_failures_total: int
    checkpoint_committed_unix: float = 0.0
    """Wall time the newest checkpoint was committed (as the agent heard it); 0: none yet."""
    checkpoint_set_aside_total: int = 0
    """Checkpoints a restore passed over (quarantined, or unreadable and left)."""
    numeric_events: tuple[tuple[str, int], ...] = ()
    """(kind, count) of the numeric events the workers reported (NaN, loss spikes), by kind."""


STARTUP_STEPS = 3
COLLECTIVE_GAPS_KEPT = 512
"""Gaps between a rank's consecutive collectives kept for `RankSnapshot.collective_gap_max_seconds`."""
"""A worker process's first steps, left out of its steady step time (`RankSnapshot.steady_step_p99_seconds`)."""
_WRITE_BEGINS = frozenset({"save_start", "staged"})
_WRITE_ENDS = frozenset({"written", "committed", "failed"})
"""Checkpoint stages that begin and end a rank's write (`RankSnapshot.writing_step_p99_seconds`). A runtime that
never reports ``written`` (older than the stage) leaves every rank but the committing one writing: all their steps
count as writing, and the deadline follows them all, as it did before."""
STEPS_AFTER_WRITE = 1
"""Steps after the one in which the job's writes here ended that still count as writing: rank 0 commits, runs its
retention and the agent publishes the commit in that one (a new worker process's first commit slowed it 2-3x on the
reference job, 0.36-0.61 s against 0.2 s: `tests/bench/bench_hang.py`'s logs, issue 26)."""


def steps_from(ranks: "Iterable[RankSnapshot]") -> str:
    """Where a job's steps come from, from its ranks' snapshots: "rt.step", "optimizer hooks" (both, joined,
    when ranks differ), "collectives only" (no step, but collectives: hang detection still has a heartbeat),
    or "" (nothing reported)."""
    ranks = list(ranks)
    sources = sorted({r.step_source or "rt.step" for r in ranks if r.step_count > 0})
    if sources:
        return " and ".join(sources)
    if any(r.collectives_seen > 0 for r in ranks):
        return "collectives only"
    return ""


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[index]


class _RankTelemetry:
    def __init__(self, info: WorkerInfo, recent_steps: int, now: float) -> None:
        self.info = info
        self.restarts = 0  # new worker processes seen for this rank
        self.streams = 1  # streams opened for this rank (Hellos), reconnects of the same process included
        self.connected = True
        self.last_seen = now
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

    def update_compute(self) -> None:
        self.compute_total = max(self.compute_total, self.step_seconds_total - self.wait_total)


class _JobRanks:
    def __init__(self, info: WorkerInfo) -> None:
        self.world_size = info.world_size
        self.mesh = dict(info.mesh)
        self.ranks: dict[int, _RankTelemetry] = {}
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

    def write_overlaps(self, rank: "_RankTelemetry") -> bool:
        """Whether `rank`'s step in flight overlaps a checkpoint write: one runs on a rank here (a save begun at a
        newer step than its write last ended), or one began or ended since the rank's last step."""
        return (rank.write_mark != self.write_events
                or any(r.write_started > r.write_ended for r in self.ranks.values()))


class TelemetryListener(Protocol):
    """Hears of steps and checkpoint stages as they are recorded (outside the store's lock, on the telemetry
    reader's thread: it must be quick and must not block). The supervisor of `trainwarden run` follows
    progress this way; the node agent publishes committed checkpoints."""

    def on_step(self, job: str, rank: int, pid: int, index: int, start_unix: float, duration_s: float) -> None:
        ...

    def on_checkpoint(self, job: str, rank: int, stage: str, step: int, path: str, nbytes: int,
                      detail: str, seconds: float = 0.0) -> None:
        ...

    # optional: on_numeric(job, rank, kind, step, first_rank, action, detail), told of numeric events


def _notify(method, *args) -> None:
    try:
        method(*args)
    except Exception:  # a listener's bug must not lose telemetry
        log.exception("telemetry listener %s failed", method)


class JobTelemetry:
    """Thread-safe store of every job's and rank's telemetry on this node."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, recent_steps: int = 256,
                 wall: Callable[[], float] = time.time,
                 listeners: Iterable["TelemetryListener"] = ()) -> None:
        self._listeners: list[TelemetryListener] = list(listeners)
        if recent_steps < 2:
            raise ValueError(f"recent_steps must be at least 2, got {recent_steps}")
        self._clock = clock
        self._wall = wall
        self._ended: dict[str, deque] = {}  # job -> (wall time, rank, pid, goodbye or None) of ended streams
        self._recent_steps = recent_steps
        self._lock = threading.Lock()
        self._jobs: dict[str, _JobRanks] = {}
        self._rejected: dict[str, int] = {reason: 0 for reason in REJECT_REASONS}
        self._overflow: dict[str, int] = {kind: 0 for kind in OVERFLOW_KINDS}

    # ---- writers -------------------------------------------------------------------------------------

    def connect(self, info: WorkerInfo) -> str | None:
        """A worker said Hello (first start, restart, or reconnect after an agent restart); or why its stream may
        not speak for its (job, rank), and nothing changes (the job belongs to another uid: module docstring)."""
        now = self._clock()
        with self._lock:
            job = self._jobs.get(info.job)
            if job is not None and job.owner_uid is not None and info.uid != job.owner_uid:
                if info.uid is None:
                    return (f"job {info.job} streams with verified peer credentials as uid {job.owner_uid}; an "
                            f"unverified stream may not speak for its rank {info.rank}")
                return (f"job {info.job} streams as uid {job.owner_uid}; a stream of uid {info.uid} may not speak "
                        f"for its rank {info.rank}")
            if job is None:
                job = self._jobs[info.job] = _JobRanks(info)
            if info.uid is not None and job.owner_uid is None:
                job.owner_uid = info.uid
            job.world_size, job.mesh = info.world_size, dict(info.mesh)
            rank = job.ranks.get(info.rank)
            if rank is None:
                job.ranks[info.rank] = _RankTelemetry(info, self._recent_steps, now)
            else:
                if rank.info.pid != info.pid:  # a new worker process for this rank: restart its deltas
                    job.matcher.reset()  # sequence ids start again in the new round
                    rank.interval_mark = None
                    rank.restarts += 1
                    job.restarts_seen = max(job.restarts_seen, rank.restarts)  # torchrun restarts all ranks
                    rank.prev_cumulative.clear()
                    rank.goodbye = None
                    rank.prev_dropped = 0
                    rank.recent.clear()
                    rank.process_steps = 0
                    rank.steady.clear()
                    rank.writing_steps.clear()
                    rank.write_started = rank.write_ended = -1
                    rank.write_tail = 0  # the old process's write ended with it
                    rank.checkpoint_stage = ""
                    rank.collective_gaps.clear()
                    rank.prev_arrival_ns = 0
                    rank.still_since = rank.pending_since = None
                rank.info, rank.connected, rank.last_seen = info, True, now
                rank.streams += 1
            job.restarts_seen = max(job.restarts_seen, info.restart_count)

    def disconnect(self, job: str, rank: int, pid: int) -> None:
        """The stream of worker `pid` ended (ignored when a newer process already holds the rank)."""
        with self._lock:
            state = self._rank(job, rank)
            if state is not None and state.info.pid == pid:
                state.connected = False
                self._ended.setdefault(job, deque(maxlen=4096)).append((self._wall(), rank, pid, state.goodbye))

    def goodbye(self, job: str, rank: int, pid: int, reason: str) -> None:
        """The worker says it is leaving (an orderly exit, unlike a stream that just breaks)."""
        with self._lock:
            state = self._rank(job, rank)
            if state is not None and state.info.pid == pid:
                state.goodbye = reason[:200]

    def update_worker(self, job: str, rank: int, pid: int, *, mesh: Mapping[str, int],
                      step_source: str, gpu_uuid: str = "") -> None:
        """A later Hello on a worker's stream: it says more about itself (a script's own ``init(mesh=...)``
        after auto-instrumentation opened the stream; ``rt.step`` taking over from the optimizer hooks)."""
        with self._lock:
            owner = self._jobs.get(job)
            state = owner.ranks.get(rank) if owner is not None else None
            if state is None or state.info.pid != pid:
                return
            if mesh:
                owner.mesh = dict(mesh)
            state.info = replace(state.info, mesh=dict(mesh) or state.info.mesh,
                                 step_source=step_source or state.info.step_source,
                                 gpu_uuid=gpu_uuid or state.info.gpu_uuid)

    def ranks_on_gpus(self, uuids: Iterable[str]) -> dict[str, dict[str, tuple[int, ...]]]:
        """Per GPU UUID, the connected ranks of each job that said they run on it: {uuid: {job: ranks}}.
        GPUs no rank named are left out (a fault there touches no job this agent knows of)."""
        wanted = {u for u in uuids if u}
        found: dict[str, dict[str, list[int]]] = {}
        with self._lock:
            for name, owner in self._jobs.items():
                for rank, state in owner.ranks.items():
                    uuid = state.info.gpu_uuid
                    if uuid in wanted and state.connected:
                        found.setdefault(uuid, {}).setdefault(name, []).append(rank)
        return {u: {job: tuple(sorted(r)) for job, r in jobs.items()} for u, jobs in found.items()}

    def ended_streams(self, job: str, since: float) -> list[dict]:
        """Streams of `job` that ended at or after wall time `since`, oldest first: who left first, and
        whether it said goodbye (a worker killed by a signal cannot)."""
        with self._lock:
            return [{"rank": rank, "pid": pid, "ended_at": round(at, 3), "goodbye": goodbye,
                     "how": f"goodbye: {goodbye}" if goodbye is not None else "broken (no goodbye)"}
                    for at, rank, pid, goodbye in self._ended.get(job, ()) if at >= since]

    def record_step(self, job: str, rank: int, *, index: int, start_unix: float, duration_seconds: float,
                    tokens: int = 0) -> None:
        with self._lock:
            state = self._rank(job, rank)
            if state is None:
                return
            pid = state.info.pid
            duration = max(0.0, float(duration_seconds))
            state.last_seen = self._clock()
            state.last_step = max(state.last_step, int(index))
            state.step_count += 1
            state.step_seconds_total += duration
            state.bucket_counts[bisect.bisect_left(STEP_BUCKETS, duration)] += 1
            state.tokens_total += max(0, int(tokens))
            state.last_step_end_ns = max(state.last_step_end_ns, int((float(start_unix) + duration) * 1e9))
            state.recent.append((float(start_unix), duration, max(0, int(tokens))))
            state.process_steps += 1
            owner = self._jobs[job]
            overlapped = owner.write_overlaps(state)
            if overlapped:
                state.write_tail = STEPS_AFTER_WRITE
            elif state.write_tail > 0:
                overlapped, state.write_tail = True, state.write_tail - 1
            state.write_mark = owner.write_events
            if state.process_steps > STARTUP_STEPS:
                (state.writing_steps if overlapped else state.steady).append(duration)
            if state.checkpoint_stage == "held":  # the hold ended without a restart: the rank trains again
                state.checkpoint_stage = ""
        for listener in self._listeners:
            _notify(listener.on_step, job, rank, pid, int(index), float(start_unix), duration)

    def add_listener(self, listener: "TelemetryListener") -> None:
        """Also tell `listener` of steps and checkpoint stages from now on."""
        with self._lock:
            self._listeners = [*self._listeners, listener]


    def record_collectives(self, job: str, rank: int, totals: Iterable[CollectiveTotals], *,
                           has_durations: bool) -> None:
        """Cumulative per-process totals from a worker; stored as monotonic agent counters."""
        with self._lock:
            state = self._rank(job, rank)
            if state is None:
                return
            state.last_seen = self._clock()
            state.has_durations = has_durations
            for t in totals:
                key = (t.process_group, t.op)
                if key not in state.prev_cumulative and len(state.prev_cumulative) >= MAX_COLLECTIVE_KEYS:
                    self._overflow["collective_keys"] += 1
                    continue
                prev_count, prev_wait = state.prev_cumulative.get(key, (0, 0.0))
                if t.count < prev_count or t.wait_seconds < prev_wait:  # counters reset: take all as new
                    prev_count, prev_wait = 0, 0.0
                d_count, d_wait = t.count - prev_count, max(0.0, t.wait_seconds - prev_wait)
                state.prev_cumulative[key] = (t.count, t.wait_seconds)
                if has_durations:  # measured completions (NCCL); on gloo, arrivals count (record_arrivals)
                    state.collectives_seen += max(0, d_count)
                old = state.collectives.get(key)
                state.collectives[key] = CollectiveTotals(
                    process_group=t.process_group, op=t.op,
                    count=(old.count if old else 0) + d_count,
                    wait_seconds=(old.wait_seconds if old else 0.0) + d_wait,
                    last_seq_id=t.last_seq_id,
                )
                if has_durations:  # measured on NCCL; on gloo the waits come from matched arrivals
                    self._add_wait(state, t.op, d_wait)
            state.update_compute()
            state.share_window.append((state.step_seconds_total, state.wait_total))
            if has_durations:
                mark = (state.step_seconds_total, state.compute_total)
                if state.interval_mark is not None and mark[0] > state.interval_mark[0]:
                    total, compute = mark[0] - state.interval_mark[0], mark[1] - state.interval_mark[1]
                    self._jobs[job].intervals.setdefault(rank, []).append(Interval(
                        state.last_step_end_ns, int(total * 1e9), int(min(total, max(0.0, compute)) * 1e9)))
                state.interval_mark = mark

    def record_arrivals(self, job: str, rank: int, arrivals: Iterable[Arrival], *, continues: bool,
                        members: Mapping[str, Iterable[int]] | None = None) -> None:
        """The rank's training-thread collective arrivals (see agent/telemetry/arrivals.py)."""
        with self._lock:
            owner = self._jobs.get(job)
            if owner is None or rank not in owner.ranks:
                return
            for group, ranks in (members or {}).items():
                owner.matcher.set_members(group, ranks)
            arrivals = list(arrivals)
            self._count_arrivals(owner.ranks[rank], arrivals, continues)
            owner.matcher.add(rank, arrivals, continues=continues)
            owner.matcher.resolve(r for r, st in owner.ranks.items() if st.connected)
            for r, waits in owner.matcher.take_waits().items():
                target = owner.ranks.get(r)
                if target is None or target.has_durations:
                    continue
                for op, seconds in waits.items():
                    self._add_wait(target, op, seconds)
                target.update_compute()

    @staticmethod
    def _count_arrivals(state: "_RankTelemetry", arrivals: list[Arrival], continues: bool) -> None:
        """Collective progress and the gaps between consecutive collectives (within unbroken stretches: a
        gap across entries the ring lost would be too long)."""
        if not arrivals:
            return
        state.collectives_seen += len(arrivals)
        previous = state.prev_arrival_ns if continues else 0
        for a in arrivals:
            t = int(a.enqueued_ns)
            if previous and t >= previous:
                state.collective_gaps.append(t - previous)
            previous = t
        state.prev_arrival_ns = previous
        state.last_collective_ns = max(state.last_collective_ns, previous)

    def _add_wait(self, state: "_RankTelemetry", op: str, seconds: float) -> None:
        if op not in state.wait_by_op and len(state.wait_by_op) >= MAX_OPS:
            self._overflow["ops"] += 1
            op = "other"
        state.wait_by_op[op] = state.wait_by_op.get(op, 0.0) + seconds
        state.wait_total += seconds

    def take_intervals(self, job: str) -> dict[int, list[Interval]]:
        """Straggler intervals per rank since the last call (one consumer: the watchdog)."""
        with self._lock:
            owner = self._jobs.get(job)
            if owner is None:
                return {}
            out = owner.matcher.take()
            for rank, intervals in owner.intervals.items():
                out.setdefault(rank, []).extend(intervals)
            owner.intervals.clear()
            return out

    def record_checkpoint(self, job: str, rank: int, *, stage: str, step: int, seconds: float,
                          bytes_: int = 0, path: str = "", detail: str = "") -> None:
        """A checkpoint stage reported by a worker; a ``committed`` one with its path goes to
        the listeners (outside the lock)."""
        if stage not in CHECKPOINT_STAGES:
            raise ValueError(f"unknown checkpoint stage {stage!r}; expected one of {CHECKPOINT_STAGES}")
        with self._lock:
            state = self._rank(job, rank)
            if state is None:
                return
            state.last_seen = self._clock()
            owner = self._jobs[job]
            if stage == "set_aside":  # reported in the middle of a restore: the rank is still restoring
                owner.checkpoint_set_aside += 1
            elif stage == "snapshot":  # written in the background, in the middle of anything: not the rank's stage
                pass
            else:
                state.checkpoint_stage = stage
            # a synchronous save reports `written` before `staged`: begun and ended are compared by step, not order
            if stage in _WRITE_BEGINS:
                state.write_started = max(state.write_started, int(step))
                owner.write_events += 1
            elif stage in _WRITE_ENDS:
                state.write_ended = max(state.write_ended, int(step))
                owner.write_events += 1
            if stage == "staged":
                state.checkpoint_stall = max(0.0, float(seconds))
            elif stage == "committed":
                owner.checkpoint_last_step = max(owner.checkpoint_last_step, int(step))
                owner.checkpoint_committed_unix = self._wall()
            elif stage == "failed":
                owner.checkpoint_failures += 1
        for listener in self._listeners:
            _notify(listener.on_checkpoint, job, rank, stage, int(step), path, int(bytes_), detail, float(seconds))

    def record_numeric(self, job: str, rank: int, *, kind: str, step: int, first_rank: int, action: str,
                       detail: str = "") -> None:
        """A numeric event a worker reported (runtime/numeric.py): counted by kind, then told to the listeners
        that have ``on_numeric`` (outside the lock)."""
        if kind not in NUMERIC_KINDS:
            raise ValueError(f"unknown numeric event {kind!r}; expected one of {NUMERIC_KINDS}")
        with self._lock:
            state = self._rank(job, rank)
            if state is None:
                return
            state.last_seen = self._clock()
            events = self._jobs[job].numeric_events
            events[kind] = events.get(kind, 0) + 1
        for listener in self._listeners:
            method = getattr(listener, "on_numeric", None)
            if method is not None:
                _notify(method, job, rank, kind, int(step), int(first_rank), action, detail)

    def record_client_stats(self, job: str, rank: int, *, dropped: int) -> None:
        """The worker's cumulative count of dropped records (per process)."""
        with self._lock:
            state = self._rank(job, rank)
            if state is None:
                return
            delta = dropped - state.prev_dropped if dropped >= state.prev_dropped else dropped
            state.prev_dropped = dropped
            state.dropped_total += delta

    def record_training_thread(self, job: str, rank: int, *, still_seconds: float,
                               collective_pending_seconds: float) -> None:
        """The worker's training thread has stayed inside one call for `still_seconds` (0: it moves again), with
        its oldest collective in flight for `collective_pending_seconds` (0: none)."""
        with self._lock:
            state = self._rank(job, rank)
            if state is None:
                return
            now = self._clock()
            state.still_since = now - still_seconds if still_seconds > 0 else None
            state.pending_since = (now - collective_pending_seconds
                                   if still_seconds > 0 and collective_pending_seconds > 0 else None)
            state.last_seen = now

    def count_rejected(self, reason: str) -> None:
        """A message was refused; `reason` is one of REJECT_REASONS (others count as "invalid")."""
        with self._lock:
            key = reason if reason in self._rejected else "invalid"
            self._rejected[key] += 1

    def set_flag(self, job: str, rank: int, flag: str, on: bool = True) -> None:
        """Raise or clear a flag shown by `trainwarden status` (e.g. "straggler", "hung")."""
        with self._lock:
            state = self._rank(job, rank)
            if state is not None:
                (state.flags.add if on else state.flags.discard)(flag)

    def set_straggler_score(self, job: str, rank: int, score: float) -> None:
        """The watchdog's latest straggler score for the rank (shown by `trainwarden status`)."""
        with self._lock:
            state = self._rank(job, rank)
            if state is not None:
                state.straggler_score = float(score)

    def prune(self, idle_seconds: float) -> list[str]:
        """Forget jobs whose ranks have all been disconnected and silent for `idle_seconds`."""
        now = self._clock()
        with self._lock:
            gone = [name for name, job in self._jobs.items()
                    if all(not r.connected and now - r.last_seen >= idle_seconds for r in job.ranks.values())]
            for name in gone:
                del self._jobs[name]
                self._ended.pop(name, None)
        return gone

    # ---- readers -------------------------------------------------------------------------------------

    def rejected(self) -> dict[str, int]:
        with self._lock:
            return dict(self._rejected)

    def overflow(self) -> dict[str, int]:
        """Telemetry not stored because it would grow the label sets without bound, by kind."""
        with self._lock:
            return dict(self._overflow)

    def owner_uid(self, job: str) -> int | None:
        """The kernel's uid of the job's first verified stream (the job's owner), None when unknown."""
        with self._lock:
            state = self._jobs.get(job)
            return state.owner_uid if state is not None else None

    def snapshot(self, job: str | None = None) -> tuple[JobSnapshot, ...]:
        with self._lock:
            now = self._clock()
            return tuple(self._job_snapshot(name, j, now) for name, j in sorted(self._jobs.items())
                         if job is None or name == job)

    def _rank(self, job: str, rank: int) -> _RankTelemetry | None:
        owner = self._jobs.get(job)
        return owner.ranks.get(rank) if owner is not None else None

    def _job_snapshot(self, name: str, job: _JobRanks, now: float) -> JobSnapshot:
        return JobSnapshot(
            job=name, world_size=job.world_size, mesh=dict(job.mesh),
            ranks=tuple(self._rank_snapshot(r, now, job) for _, r in sorted(job.ranks.items())),
            restarts_total=job.restarts_seen, checkpoint_last_step=job.checkpoint_last_step,
            checkpoint_failures_total=job.checkpoint_failures,
            checkpoint_committed_unix=job.checkpoint_committed_unix, checkpoint_set_aside_total=job.checkpoint_set_aside,
            numeric_events=tuple(sorted(job.numeric_events.items())),
        )

    @staticmethod
    def _rank_snapshot(r: _RankTelemetry, now: float, job: _JobRanks) -> RankSnapshot:
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
        )

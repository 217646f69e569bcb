"""What readers of the telemetry store see: frozen snapshots of a job and its ranks, and what a worker says of itself.

The store (agent/telemetry/job_telemetry.py) builds these under its lock (agent/telemetry/rank_state.py); the
watchdog, the job metrics collector, the ``Status`` RPC and ``trainwarden run`` read them without holding it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

__all__ = ["CollectiveTotals", "JobSnapshot", "RankSnapshot", "WorkerInfo", "steps_from"]


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
    steps_promised: bool = False
    """The rank's last batch of steps promised the next one (it holds its steps back while they keep ending,
    runtime/send_pace.py) and that promise still holds, with room for a late sender: its steps go on."""
    steps_stopped: bool = False
    """The rank said its steps stopped (a batch promising nothing after one that promised) and has promised
    nothing since: what it reported is all there is."""
    steps_overdue: bool = False
    """Its promise still holds, but the batch it promised is later than promised and a look: a late sender, or a
    frozen one (SIGSTOP) that can never withdraw its promise; the watchdog asks its process which."""


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

    def pipeline_stages(self) -> dict[int, int]:
        """Rank -> pipeline stage: runtime/examples/parallel.py builds the ("pp", "dp", "tp") mesh, pp outermost."""
        pp = int(self.mesh.get("pp", 1) or 1)
        if pp <= 1 or self.world_size % pp:
            return {r.rank: 0 for r in self.ranks}
        return {r.rank: r.rank // (self.world_size // pp) for r in self.ranks}


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

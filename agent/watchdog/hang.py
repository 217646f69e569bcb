"""Hang detection: the adaptive deadline and per-job progress tracking.

A job is hung when no rank of it completed a step for longer than its deadline. In synchronous training
one stuck rank stops every rank within a step (they all wait for it in the next collective), so "no rank
progressed" is the signal, and "some ranks progress while one does not" cannot last long enough to matter:
we do not look for it. Progress means a rank's count of completed steps grew; the step index is not used,
because a job resumed from a checkpoint repeats indices it already reported.

The deadline adapts to the job:

- steady state: ``multiplier`` x the p99 of recent step times, clamped to [``floor_s``, ``ceiling_s``].
  The defaults (5x, 1.5 s, 300 s) detect a hang of a job with 0.3 s steps in about 1.5 s (plus the watchdog's
  period and the diagnostics wait: about 2 s to the abort), and give a job with 60 s steps 300 s. The floor is
  short because what else stops steps for seconds is told apart below: a rank that computes (or whose
  DataLoader workers do), reads or writes, checkpoints, or runs collectives is not hung. What is left looks
  exactly like a hang (no step, no collective, no CPU, no I/O): a script that sleeps for seconds between steps
  needs a longer floor (`trainwarden run --hang-floor`). It was 5 s until issue 26 (recovery in seconds), then
  2 s; at 1.5 s it no longer sets the reference job's deadline (5 x its p99, about 1.5 s, does).
  The steps that overlapped a checkpoint's background write (slowed 2-3x by it on a busy host) are not in that
  p99; they count only while a write may slow the step in flight (agent/watchdog/loop.py `_steady_step_p99`).
- start-up: until a step completed since the job's (re)start (a new worker round: new pids), the deadline is at
  least ``startup_s``: rendezvous, process-group creation, compilation and the checkpoint restore all happen
  before the first step ends. Then, until ``warmup_steps`` steps did, at least ``warmup_s``: the first steps are
  slow (a step needs every rank, so one step done on any rank means the round's start-up is over). A stall of the
  first steps was held to ``startup_s`` too, until the soak's hour lost a job to it (a SIGSTOP 2 steps after a
  restart: 300 s to the abort).
- checkpoint: while any rank is inside a blocking checkpoint stage (``save_start`` until ``staged``,
  ``restore_start`` until ``restored``; see BLOCKING_CHECKPOINT_STAGES) the deadline is at least
  ``checkpoint_s``, counted from the last time the ranks in such a stage moved ``checkpoint_io_bytes``
  (read or written, from /proc/<pid>/io): a restore of 2 TB from a slow filesystem that keeps reading
  is never aborted, however long it takes, and one that stopped moving bytes is a hang after
  ``checkpoint_s``. After ``staged`` the write continues in the background and steps go on.

Collectives are progress too. Every rank reports the collectives it enters (gloo: the Flight Recorder's
enqueue records) or completes (NCCL with timing); when their count grows, some collective completed on every
member, so the job is alive even between steps: an evaluation pass with its all-reduces, a loop without an
optimizer. A stuck rank stops its peers at their next collective, so the count stops with the steps.

- A job that reports steps keeps the step deadline (collectives only keep it alive longer, in the work
  between steps).
- A job that reports no step in its round ("collectives only": a script with no optimizer, auto-instrumented)
  gets the deadline from its collectives once ``warmup_collectives`` of them completed since the round
  started: ``multiplier`` x the longest gap between two consecutive collectives of a rank in its recent
  ones, clamped like the step deadline, plus how late they can be reported (``collective_report_s``: a rank
  reports its collectives only when it reads its Flight Recorder, every 1.5 s or at the slower pace the agent
  asked for, and sends them at its next flush, 0.5 s: a healthy job's collectives can go unheard for 2 s, 3.5 s
  at the slow pace). Before that, the start-up deadline.

Work between steps with no collective and no step (a long evaluation on one rank while the others wait in a
barrier, say) is told from a hang by the processes' activity: while the ranks' process trees (a rank and its
children: a DataLoader's workers preparing an epoch's first batches while the rank waits for them) keep using
at least ``busy_cores`` of CPU together, or their processes read or write at least ``busy_io_bytes_per_s`` (a
shard streamed from remote storage), the deadline is at least ``busy_s`` (300 s). Together, not per rank: eight
ranks that each get a quarter of a core on an oversubscribed host are working. A deadlocked or stopped rank does
neither, and neither do ranks blocked in a gloo collective, so hangs are caught as before; a rank spinning forever
is caught after ``busy_s``. A rank of a GPU job blocked in a hung NCCL collective does spin a core: its training
thread waits inside one CUDA synchronize (the default schedule spins while the host has cores to spare). Such a
rank says so: its training thread has stayed inside one call (the same innermost Python frame and instruction)
while a collective it enqueued has not completed (the Flight Recorder). Its own CPU is then not counted
(``waiting_cpu_seconds``); its children's CPU and its I/O still are. Without this, every NCCL hang was held to
``busy_s``. A rank computing alone while its peers wait has no collective in flight: it still counts. (An
unchanged script, auto-instrumented, was otherwise aborted in the middle of an 8 s
evaluation on one rank.) The watchdog reads activity only once a job has been stalled for 0.75 s: a healthy
job costs it nothing.

A node sees only its own ranks. In a job of several nodes, the ranks of one node may work (rank 0 evaluating
alone) while every other node's ranks wait for them: each node says while its ranks work (``HangCheck.working``,
published by the watchdog through etcd), and a node that would declare a hang while another works ``defer``s it.

After firing, a job is not judged again until it progresses or a new worker round starts (the restart
that the abort causes), so one hang gives one incident. A job none of whose ranks is connected is not
running (finished, or between rounds); its clock is paused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Mapping

__all__ = ["BLOCKING_CHECKPOINT_STAGES", "WORKING_WITHIN_S", "HangCheck", "HangConfig", "HangDetector"]

BLOCKING_CHECKPOINT_STAGES = frozenset({"save_start", "restore_start"})
WORKING_WITHIN_S = 1.0


@dataclass(frozen=True, kw_only=True)
class HangConfig:
    """How long a job may go without progress before it is declared hung."""

    multiplier: float = 5.0
    """Deadline = multiplier x p99 of recent step times (then clamped)."""
    floor_s: float = 1.5
    """Shortest deadline in steady state (see the module docstring for why it can be short)."""
    ceiling_s: float = 300.0
    """Longest deadline in steady state."""
    startup_s: float = 300.0
    """Deadline until a step completed since the (re)start (rendezvous, process groups, restore, compilation)."""
    warmup_steps: int = 3
    """Steps that must complete after a (re)start before the steady-state deadline applies."""
    warmup_s: float = 30.0
    """Deadline (at least; at most `startup_s`) once a step completed since the (re)start, until `warmup_steps` did.
    It was `startup_s` until then: in the soak's hour a rank SIGSTOPped 2 steps after a restart was not a hang for
    300 s, and the soak gave up on the job after 240 s; a hang 1 step after a grow-back was aborted after 300 s."""
    warmup_collectives: int = 64
    """Collectives a job that reports no step must complete after a (re)start before its deadline follows
    the gaps between its collectives (until then: ``startup_s``)."""
    checkpoint_s: float = 180.0
    """Deadline while a rank is inside a blocking checkpoint stage, counted from the stage's last I/O
    progress (a constant allowance turned every restore longer than it into an abort-restore loop)."""
    busy_s: float = 300.0
    """Deadline while the ranks keep working (`busy_cores` of CPU or `busy_io_bytes_per_s` since the last check)."""
    busy_cores: float = 0.5
    """CPU seconds per second the ranks' process trees must use together to count as computing (blocked ones use
    ~0: their telemetry threads, about 0.01 each)."""
    busy_io_bytes_per_s: float = float(1 << 20)
    """Bytes per second the ranks' processes must read or write together to count as working (blocked ones move
    only their telemetry: a few kB a second each)."""
    checkpoint_io_bytes: int = 1 << 20
    """Bytes the ranks in a blocking checkpoint stage must read or write to count as progress (more than
    their own telemetry and log lines move while stuck)."""

    def __post_init__(self) -> None:
        if not self.multiplier >= 1.0:
            raise ValueError(f"multiplier must be at least 1 (a deadline shorter than a step), got {self.multiplier}")
        if not 0 < self.floor_s <= self.ceiling_s:
            raise ValueError(f"need 0 < floor_s <= ceiling_s, got floor_s={self.floor_s} ceiling_s={self.ceiling_s}")
        if self.startup_s < self.floor_s or self.checkpoint_s < self.floor_s:
            raise ValueError(f"startup_s ({self.startup_s}) and checkpoint_s ({self.checkpoint_s}) must not be "
                             f"below floor_s ({self.floor_s}): they extend the deadline")
        if self.warmup_s < 0:
            raise ValueError(f"warmup_s must be 0 or more, got {self.warmup_s}")
        if self.checkpoint_io_bytes < 1:
            raise ValueError(f"checkpoint_io_bytes must be at least 1, got {self.checkpoint_io_bytes}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be 0 or more, got {self.warmup_steps}")

    def steady_timeout(self, step_p99_s: float) -> float:
        """The steady-state deadline for a job whose recent step p99 is `step_p99_s` (0: unknown)."""
        return min(self.ceiling_s, max(self.floor_s, self.multiplier * max(0.0, step_p99_s)))


@dataclass(frozen=True, kw_only=True)
class HangCheck:
    """The outcome of one observation of a job."""

    job: str
    hung: bool
    """True exactly once per hang: the deadline passed and the job was armed."""
    stalled_s: float
    """Seconds since the job last progressed (or since its round started)."""
    timeout_s: float
    """The deadline that applied."""
    reason: str
    """Which deadline applied: "steady", "startup", "warmup", "checkpoint", "collectives" or "busy"."""
    steps_since_start: int
    """Steps completed since the current worker round started (max over ranks)."""
    min_steps_since_start: int = 0
    """Steps every rank has completed since the round started (min over ranks)."""
    progressed: bool
    """The job progressed in this observation."""
    heartbeat: str = "steps"
    """What the deadline followed: "steps", or "collectives" (a job with no step in its round)."""
    working: bool = False
    """The job is stalled and its ranks here worked within the last ``WORKING_WITHIN_S`` (the activity rule): what
    a node tells the job's other nodes, whose own ranks may only be waiting for these (agent/etcd/cluster.py)."""

    @property
    def silent(self) -> str:
        """What stopped coming: a job without steps is judged by its collectives."""
        return "collective" if self.heartbeat == "collectives" else "step or collective"

    @property
    def words(self) -> str:
        """The start of a hang's abort reason, which the workers log ("aborted by the trainwarden agent: ...")."""
        return f"hang: no {self.silent} for {self.stalled_s:.1f} s"


@dataclass
class _JobProgress:
    round_id: Hashable
    round_start: float
    baseline: dict[int, int] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)
    collective_baseline: dict[int, int] = field(default_factory=dict)
    collective_counts: dict[int, int] = field(default_factory=dict)
    last_progress: float = 0.0
    armed: bool = True
    in_checkpoint: bool = False
    io_seen: dict[int, int] = field(default_factory=dict)  # rank -> bytes moved, while in a blocking stage
    io_moved: int = 0  # bytes moved since the last progress
    cpu_seen: dict[int, tuple[float, float]] = field(default_factory=dict)  # rank -> (clock, CPU seconds)
    activity_io_seen: dict[int, tuple[float, float]] = field(default_factory=dict)  # rank -> (clock, bytes moved)
    waiting_cpu_seen: dict[int, tuple[float, float]] = field(default_factory=dict)  # rank -> (clock, own CPU s)
    last_busy: float = 0.0  # the last observation in which some rank was computing (here, or on another node)
    last_working: float = 0.0  # the last observation in which some rank here was computing
    flowing: bool = False  # the ranks promised their next batch of steps: they go on (not stalled, not hung)


class HangDetector:
    """Tracks every job's progress and applies the deadline; not thread-safe (one watchdog thread)."""

    def __init__(self, config: HangConfig | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or HangConfig()
        self._clock = clock
        self._jobs: dict[str, _JobProgress] = {}

    def observe(self, job: str, *, round_id: Hashable, step_counts: Mapping[int, int], step_p99_s: float,
                in_checkpoint: bool, running: bool, checkpoint_io: Mapping[int, int] | None = None,
                progress_age_s: float = 0.0, collective_counts: Mapping[int, int] | None = None,
                collective_gap_s: float = 0.0, collective_age_s: float = 0.0,
                collective_report_s: float = 0.0,
                cpu_seconds: Mapping[int, float] | None = None,
                io_bytes: Mapping[int, int] | None = None,
                waiting_cpu_seconds: Mapping[int, float] | None = None,
                steps_flowing: bool = False) -> HangCheck:
        """Feed the job's current state and learn whether it is hung.

        `round_id` changes when the workers are replaced (e.g. the ranks' pids); `step_counts` maps rank to
        its cumulative count of completed steps; `running` is False while no rank is connected;
        `checkpoint_io` maps each rank inside a blocking checkpoint stage to the cumulative bytes its process
        read and wrote (ranks whose counters cannot be read are left out); `progress_age_s` is how long
        before now the newest reported step ended: steps reach the agent in batches, so a step's progress
        counts from when it happened, not from when its batch arrived (the caller bounds it).
        `collective_counts` maps rank to its cumulative count of collectives (module docstring),
        `collective_gap_s` is the longest recent gap between a rank's consecutive collectives and
        `collective_age_s` how long before now the newest reported one was entered, `collective_report_s` the
        longest a rank's collectives may go unreported however often it runs them (its read period plus the
        flush: added to the collectives deadline); `cpu_seconds` maps rank
        to the CPU seconds its process tree has used and `io_bytes` to the bytes its process has read and
        written (ranks whose counters cannot be read are left out; None: not read this time, and the next
        reading is a new baseline); `waiting_cpu_seconds` maps the ranks that wait inside one call (module
        docstring) to their process's own CPU seconds, which are then not work. `steps_flowing`: the ranks hold
        their steps back while they keep ending and have promised the next batch (runtime/send_pace.py), so the
        steps go on now, whatever the newest one heard of.
        """
        now = self._clock()
        state = self._jobs.get(job)
        if state is None or state.round_id != round_id:
            state = self._jobs[job] = _JobProgress(round_id=round_id, round_start=now, last_progress=now)
        progressed = _moved(state.counts, state.baseline, step_counts)
        collectives_moved = _moved(state.collective_counts, state.collective_baseline, collective_counts or {})
        if collectives_moved:
            state.last_progress = max(state.last_progress, now - max(0.0, collective_age_s))
            state.armed = True
        if progressed:
            state.last_progress = max(state.last_progress, now - max(0.0, progress_age_s))
            state.armed = True
        # leaving a blocking checkpoint stage is progress: the next step's report is still on its way, and
        # measuring from the last step would call a long save a hang the moment it ends
        left_checkpoint = state.in_checkpoint and not in_checkpoint
        state.in_checkpoint = in_checkpoint
        io_progressed = self._checkpoint_io(state, checkpoint_io if in_checkpoint else None)
        if left_checkpoint or io_progressed or not running:
            state.last_progress = now  # not running: the clock is paused
        done = [state.counts[r] - state.baseline[r] for r in state.counts]
        steps = max(done, default=0)
        collectives = max((state.collective_counts[r] - state.collective_baseline[r]
                           for r in state.collective_counts), default=0)
        heartbeat, timeout, reason = self._deadline(
            steps, collectives, step_p99_s=step_p99_s, collective_gap_s=collective_gap_s,
            collective_report_s=collective_report_s, in_checkpoint=in_checkpoint)
        if self._busy(state, now, cpu_seconds, io_bytes, waiting_cpu_seconds):
            state.last_busy = state.last_working = now
        # steps that go on but reach the agent in a while leave the newest one heard of a few seconds old, and
        # that is not a stall; once the ranks say they stopped, or their promises lapse, it counts from that step
        state.flowing = steps_flowing and state.armed
        stalled = 0.0 if state.flowing else now - state.last_progress
        if state.flowing:
            hung = False
        else:
            hung, timeout, reason = self._judge(state, now, stalled, running=running, timeout=timeout, reason=reason)
        # this node's own activity only: a deferral is not work, or two waiting nodes would hold each other back
        working = (running and state.last_working > state.last_progress
                   and now - state.last_working <= WORKING_WITHIN_S)
        return HangCheck(job=job, hung=hung, stalled_s=stalled, timeout_s=timeout, reason=reason,
                         steps_since_start=steps, min_steps_since_start=min(done, default=0),
                         progressed=progressed or collectives_moved, heartbeat=heartbeat, working=working)

    def _deadline(self, steps: int, collectives: int, *, step_p99_s: float, collective_gap_s: float,
                  collective_report_s: float, in_checkpoint: bool) -> tuple[str, float, str]:
        """(heartbeat, deadline, why that deadline): steps, or collectives for a job that has none; the steady
        deadline, the start-up one, the checkpoint one (module docstring)."""
        heartbeat = "collectives" if steps == 0 and collectives >= self.config.warmup_collectives else "steps"
        if heartbeat == "collectives":  # heard from once a read: the deadline counts from when they can arrive
            timeout = min(self.config.ceiling_s,
                          self.config.steady_timeout(collective_gap_s) + max(0.0, collective_report_s))
            reason = "collectives"
        else:
            timeout, reason = self.config.steady_timeout(step_p99_s), "steady"
            # before any step of the round: the start-up's unmeasured work; after one, the steps' own slowness
            warm_up = self.config.startup_s if steps == 0 else min(self.config.warmup_s, self.config.startup_s)
            if steps < self.config.warmup_steps and warm_up > timeout:
                timeout, reason = warm_up, "startup" if steps == 0 else "warmup"
        if in_checkpoint and self.config.checkpoint_s > timeout:
            timeout, reason = self.config.checkpoint_s, "checkpoint"
        return heartbeat, timeout, reason

    def _judge(self, state: _JobProgress, now: float, stalled: float, *, running: bool, timeout: float,
               reason: str) -> tuple[bool, float, str]:
        """(hung, deadline, why). A rank that computes is not stalled: the deadline runs from the later of the last
        progress and the last moment some rank computed (its first steps after the work arrive in the next batch),
        and a stall with computing in it gets `busy_s` in all. A hang disarms the job until it progresses again."""
        quiet = now - max(state.last_progress, state.last_busy)
        if state.last_busy > state.last_progress and self.config.busy_s > timeout:
            hung = running and state.armed and (stalled >= self.config.busy_s or quiet >= timeout)
            reason = "busy" if stalled >= self.config.busy_s or quiet < timeout else reason
            timeout = self.config.busy_s if reason == "busy" else timeout
        else:
            hung = running and state.armed and stalled >= timeout
        if hung:
            state.armed = False
        return hung, timeout, reason

    def defer(self, job: str) -> None:
        """Another node's ranks work while this job is stalled (its ranks here wait for them): count it as work
        seen now, and judge the job again after a whole deadline of quiet (or ``busy_s`` in all)."""
        state = self._jobs.get(job)
        if state is not None:
            state.last_busy = self._clock()
            state.armed = True

    def _busy(self, state: _JobProgress, now: float, cpu: Mapping[int, float] | None,
              io: Mapping[int, int] | None, waiting: Mapping[int, float] | None) -> bool:
        """The ranks' process trees used at least `busy_cores` of CPU together (less the own CPU of ranks that wait
        inside one call), or their processes moved at least `busy_io_bytes_per_s`, since the previous reading (a
        missing reading drops the baselines)."""
        if cpu is None or waiting is None:
            state.waiting_cpu_seen.clear()
        else:  # a rank that stopped waiting starts a new baseline when it waits again
            for rank in set(state.waiting_cpu_seen) - set(waiting):
                del state.waiting_cpu_seen[rank]
            for rank in set(waiting) - set(state.waiting_cpu_seen):
                state.cpu_seen.pop(rank, None)  # and its spin since the last reading is not counted either
        computing = self._rate(state.cpu_seen, now, cpu) - self._rate(state.waiting_cpu_seen, now, waiting or {})
        busy = computing >= self.config.busy_cores
        return self._rate(state.activity_io_seen, now, io) >= self.config.busy_io_bytes_per_s or busy

    @staticmethod
    def _rate(seen: dict, now: float, totals: Mapping[int, float] | None) -> float:
        """How fast the ranks' counters grew together since their last readings in `seen` (per second). Summed:
        eight ranks that each get a quarter of a core on an oversubscribed host are working, not hung."""
        if totals is None:
            seen.clear()
            return 0.0
        rate = 0.0
        for rank, total in totals.items():
            before = seen.get(rank)
            if before is not None and now > before[0] and total >= before[1]:
                rate += (total - before[1]) / (now - before[0])
            seen[rank] = (now, total)
        return rate

    def stalled_s(self, job: str) -> float:
        """Seconds since `job` last progressed, as of its last observation (0: unknown job)."""
        state = self._jobs.get(job)
        return 0.0 if state is None or state.flowing else self._clock() - state.last_progress

    def _checkpoint_io(self, state: _JobProgress, io: Mapping[int, int] | None) -> bool:
        """True when the ranks in a blocking checkpoint stage moved enough bytes since the last progress.
        A rank's first reading (it just entered the stage, or its process changed) is only a baseline."""
        if not io:
            state.io_seen.clear()
            state.io_moved = 0
            return False
        for rank, total in io.items():
            before = state.io_seen.get(rank)
            if before is not None and total > before:
                state.io_moved += total - before
            state.io_seen[rank] = total
        for rank in set(state.io_seen) - set(io):
            del state.io_seen[rank]
        if state.io_moved >= self.config.checkpoint_io_bytes:
            state.io_moved = 0
            return True
        return False

    def forget(self, job: str) -> None:
        """Drop a job that disappeared."""
        self._jobs.pop(job, None)

    def jobs(self) -> list[str]:
        return sorted(self._jobs)


def _moved(counts: dict[int, int], baseline: dict[int, int], now: Mapping[int, int]) -> bool:
    """Record each rank's cumulative count; True when one rose past its last (a rank's first count is its
    baseline)."""
    moved = False
    for rank, count in now.items():
        baseline.setdefault(rank, count)
        if count > counts.get(rank, baseline[rank]):
            moved = True
        counts[rank] = count
    return moved

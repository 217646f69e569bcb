"""Per-job, per-rank state aggregated from worker telemetry.

The telemetry server feeds this store from every worker stream on the node; the job metrics collector,
the `Status` RPC and the watchdog read it. It knows nothing about gRPC or protobuf: the server converts
messages into the plain calls below, so tests and other readers can drive it directly. What readers get is in
agent/telemetry/snapshots.py; the per-rank and per-job state behind it, and how a snapshot is made of it, in
agent/telemetry/rank_state.py.

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
  `prune()`, which keeps the label sets of the exported metrics bounded. A disconnected rank whose local rank a
  rank of another global rank took after it ended is dropped: a node that rejoins a job that changed size may hold
  other ranks now, and the old ones are not its to watch or name.
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
from dataclasses import replace
from typing import Callable, Iterable, Mapping, Protocol

from trainwarden.agent.shared.contract import CHECKPOINT_STAGES, NUMERIC_KINDS
from trainwarden.agent.telemetry.arrivals import Arrival, Interval
from trainwarden.agent.telemetry.rank_state import (STARTUP_STEPS, STEP_BUCKETS, STEPS_AFTER_WRITE, WRITE_BEGINS,
                                                    WRITE_ENDS, JobRanks, RankState, job_snapshot)
from trainwarden.agent.telemetry.snapshots import CollectiveTotals, JobSnapshot, RankSnapshot, WorkerInfo, steps_from

log = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINT_STAGES",
    "REJECT_REASONS",
    "STARTUP_STEPS",
    "STEP_BUCKETS",
    "CollectiveTotals",
    "JobSnapshot",
    "JobTelemetry",
    "TelemetryListener",
    "RankSnapshot",
    "WorkerInfo",
    "steps_from",
]

# Bounded `reason` label values for trainwarden_telemetry_rejected_total.
REJECT_REASONS = ("malformed", "oversized", "no_hello", "invalid", "unverified", "identity", "limit")
"""``unverified``: a Hello or Commit without peer credentials where they are required; ``identity``: a stream or
Commit refused for who the kernel says it is (another uid than the job's, not the rank's stream)."""
MAX_COLLECTIVE_KEYS = 64
"""(process group, op) pairs kept per rank; a worker naming more is counted, not stored (bounded labels)."""
MAX_OPS = 32
"""Distinct op label values per rank; more fold into "other"."""
OVERFLOW_KINDS = ("collective_keys", "ops")


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
        self._jobs: dict[str, JobRanks] = {}
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
                job = self._jobs[info.job] = JobRanks(info)
            if info.uid is not None and job.owner_uid is None:
                job.owner_uid = info.uid
            job.world_size, job.mesh = info.world_size, dict(info.mesh)
            rank = job.ranks.get(info.rank)
            if rank is None:
                job.ranks[info.rank] = RankState(info, self._recent_steps, now)
            else:
                if rank.info.pid != info.pid:  # a new worker process for this rank: restart its deltas
                    job.matcher.reset()  # sequence ids start again in the new round
                    rank.new_process()
                    job.restarts_seen = max(job.restarts_seen, rank.restarts)  # torchrun restarts all ranks
                rank.info, rank.connected, rank.last_seen, rank.stream_since = info, True, now, now
                rank.streams += 1
                rank.new_stream()
            job.restarts_seen = max(job.restarts_seen, info.restart_count)
            _retire_earlier_rounds(job)

    def disconnect(self, job: str, rank: int, pid: int) -> None:
        """The stream of worker `pid` ended (ignored when a newer process already holds the rank)."""
        with self._lock:
            state = self._rank(job, rank)
            if state is not None and state.info.pid == pid:
                state.connected, state.ended_at = False, self._clock()
                self._ended.setdefault(job, deque(maxlen=4096)).append((self._wall(), rank, pid, state.goodbye))
                _retire_earlier_rounds(self._jobs[job])

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

    def record_steps_promise(self, job: str, rank: int, within_s: float) -> None:
        """A batch of steps said when the next comes (``Steps.next_within_seconds``; 0: no promise)."""
        with self._lock:
            state = self._rank(job, rank)
            if state is not None:
                state.promise(within_s, self._clock())

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
    def _count_arrivals(state: RankState, arrivals: list[Arrival], continues: bool) -> None:
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

    def _add_wait(self, state: RankState, op: str, seconds: float) -> None:
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
            if stage in WRITE_BEGINS:
                state.write_started = max(state.write_started, int(step))
                owner.write_events += 1
            elif stage in WRITE_ENDS:
                state.write_ended = max(state.write_ended, int(step))
                owner.write_events += 1
            if stage == "staged":
                state.checkpoint_stall = max(0.0, float(seconds))
            elif stage == "committed":
                owner.checkpoint_last_step = max(owner.checkpoint_last_step, int(step))
                owner.checkpoint_committed_unix = self._wall()
            elif stage == "failed":
                owner.checkpoint_failures += 1
            elif stage == "restored":  # its last finished step now: the ones after it were lost and are redone,
                state.last_step = int(step) if step > 0 else -1  # and every node, its agent old or new, names a
                # hang alike (cluster_hang.hang_key); step 0 is a fresh start: no step yet
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
            return tuple(job_snapshot(name, j, now) for name, j in sorted(self._jobs.items())
                         if job is None or name == job)

    def _rank(self, job: str, rank: int) -> RankState | None:
        owner = self._jobs.get(job)
        return owner.ranks.get(rank) if owner is not None else None


def _retire_earlier_rounds(job: JobRanks) -> None:
    """Forget the ranks this node held in an earlier worker round and holds no more (module docstring): a
    disconnected rank whose local rank a connected rank of another global rank took after it ended. A node that
    rejoined a grown job as ranks 4-7 named its old ranks 0-3 in its next hang ("rank 0 is dead"), the probe of their
    old pids. (torchrun's restart count does not tell the rounds apart: a membership restart leaves it as it was.)
    A rank whose stream dropped in the current round stays (it is probed), and so does one not restarted yet."""
    taken = {}
    for r in job.ranks.values():
        if r.connected:
            taken.setdefault(r.info.local_rank, []).append(r)
    if not taken:
        return
    for rank in [n for n, r in job.ranks.items() if not r.connected
                 and any(c.info.rank != n and c.stream_since >= r.ended_at for c in taken.get(r.info.local_rank, ()))]:
        del job.ranks[rank]
        job.intervals.pop(rank, None)

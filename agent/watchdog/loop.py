"""The watchdog: a loop over the node's jobs that detects hangs and stragglers and acts through `actions`.

Every `interval_s` it takes one `JobTelemetry.snapshot()` and, per job:

- feeds the ranks' completed-step counts to `HangDetector` (agent/watchdog/hang.py). On a hang it asks every
  connected local rank for diagnostics (`actions.request_diagnostics`), waits up to `diagnostics_wait_s`
  for their dumps (less once every rank still silent is stopped or dead: it cannot answer), names the
  culprit (agent/watchdog/culprit.py; ranks that did not answer are probed: stopped, dead, disconnected),
  records a `hang` incident, aborts the local workers (`actions.abort`) and keeps the incident in `acting`
  until the job progresses again (then `resolved`). An abort that fails marks it
  `failed`. The detector does not fire again for the job until it progresses or a new worker round starts.
- feeds the job's straggler intervals (`JobTelemetry.take_intervals`: collective arrivals matched across the
  node's ranks, agent/telemetry/arrivals.py) to `StragglerDetector` (agent/watchdog/straggler.py), with the pipeline stage
  as the peer group and the median step time as the unit of its window. A start event records a `straggler_start` incident and raises the
  rank's "straggler" flag in the JobTelemetry; an end event records `straggler_end`, resolves the start
  incident and clears the flag.
- paces the ranks' Flight Recorder reads (`read_pace.py`, `actions.set_read_pace`): every `quiet_read_period_s`
  while neither the straggler nor the comm-regression detector has been near a decision on the job for
  `quiet_after_s`, at the workers' own pace again as soon as one is (a read holds the worker's GIL for
  milliseconds).

Evidence first, one decision, recorded: the incident is written before the abort. The loop survives a bad
iteration (logged, counted in trainwarden_watchdog_errors_total), stops with an Event and `join(timeout)`.
The hang path blocks the loop for up to `diagnostics_wait_s`; other jobs are checked after it. Each iteration
beats a `Heartbeat` (agent/common/heartbeat.py): `liveness()` reports a loop that has ended or has finished no
iteration for `STALL_S`, and the daemon then stops its systemd keep-alives.

`actions` is the outside world (see `WatchdogActions`); tests pass a fake, the agent the real one. Metric
families come from `collector()`: straggler score and flag per rank, the hang deadline and the seconds
since progress per job.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from trainwarden.agent.watchdog.activity import ProcessActivity, waits
from trainwarden.agent.watchdog.culprit import (RankEvidence, give_to_writers, name_culprit, process_cpu_seconds,
                                                process_io_bytes, process_own_cpu_seconds, process_state,
                                                read_diagnostics)
from trainwarden.agent.watchdog.hang import BLOCKING_CHECKPOINT_STAGES, HangCheck, HangDetector
from trainwarden.agent.etcd.cluster import merge_verdicts
from trainwarden.agent.incidents import Incident, IncidentKind, IncidentState, new_incident_id
from trainwarden.agent.telemetry.job_telemetry import STARTUP_STEPS, JobSnapshot, RankSnapshot
from trainwarden.agent.common.heartbeat import Heartbeat
from trainwarden.agent.common.paths import job_state_dir
from trainwarden.agent.shared.contract import trace_file
from trainwarden.agent.watchdog.straggler_trace import TraceWriter
from trainwarden.agent.watchdog.interface import WatchdogActions, WatchdogConfig
from trainwarden.agent.watchdog.comm_watch import CommRegressionWatch
from trainwarden.agent.watchdog.straggler import StragglerDetector
from trainwarden.agent.watchdog.cluster_hang import ClusterHangs, hang_key
from trainwarden.agent.watchdog.read_pace import ReadPacer
from trainwarden.agent.watchdog.stand_down import StandDowns
from trainwarden.agent.watchdog.straggler_incidents import StragglerIncidents

__all__ = ["STALL_S", "Watchdog", "WatchdogActions", "WatchdogConfig"]

log = logging.getLogger(__name__)
_POLL_S = 0.05
REPORT_AGE_CAP_S = 1.0
"""The least a report may count as late: progress counts from a step's end or a collective's entry, up to the
longest its report can take (``ReadPacer.step_report_s`` while some rank holds its steps, 2.5 s or more; a read
period and a flush for collectives, ``collective_report_s``, 6.5 s at the quiet pace), and never less than this,
before its batch arrived. No more than that: a wall clock stepped forward (which would make every event look
old) cannot make a hang of a report that came as soon as it could. Until session 39 this was the cap on every
report: a quiet read reporting a waiting rank's collectives 5 s after it entered them counted them 1 s old, and the
node judged a SIGSTOP 5.9 s after the other (the soak)."""
ACTIVITY_AFTER_S = 0.75
"""A job stalled this long has its ranks' CPU and I/O read each check (is some rank working, not hung?); a job
that progresses is not read at all. Half the shortest deadline: the first reading is a baseline, the next,
a period later, a rate. (1 s with the 2 s floor.)"""
STALL_S = 120.0
"""An iteration that has not finished after this long is wedged, not slow: one that handles a hang takes the
diagnostics wait, the other nodes' verdicts (3 s) through etcd calls bounded by the client's timeout, and the
abort's grace before SIGKILL; about 15 s per hung job."""


class Watchdog:
    """Runs hang and straggler policies over `job_telemetry` in a daemon thread; see the module docstring."""

    def __init__(self, job_telemetry, actions: WatchdogActions, *, node: str, config: WatchdogConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 sleep: Callable[[float], object] | None = None,
                 probe: Callable[[int], str] = process_state,
                 io_bytes: Callable[[int], int | None] = process_io_bytes,
                 cpu_seconds: Callable[[int], float | None] = process_cpu_seconds,
                 own_cpu_seconds: Callable[[int], float | None] = process_own_cpu_seconds,
                 diagnostics_dir: Callable[[str], Path] = lambda job: job_state_dir(job) / "diagnostics",
                 cluster=None) -> None:
        """``cluster``: a ``HangCoordinator`` (agent/etcd/cluster.py) for jobs of several nodes: one node records
        each hang and names its culprit from every node's verdict; None acts alone."""
        self.config = config or WatchdogConfig()
        self._job_telemetry, self._actions, self._node = job_telemetry, actions, node
        self._clock, self._wall, self._probe, self._diagnostics_dir = clock, wall, probe, diagnostics_dir
        self._activity = ProcessActivity(io_bytes=io_bytes, cpu_seconds=cpu_seconds, own_cpu_seconds=own_cpu_seconds)
        self._stop = threading.Event()
        self._sleep = sleep or self._stop.wait
        self._hang = HangDetector(self.config.hang, clock=clock)
        self._cluster = ClusterHangs(cluster, self._hang, lambda i: self._actions.record(i), clock=clock, wall=wall) \
            if cluster is not None else None
        self._late = self._cluster.late if self._cluster is not None else None
        self._straggler = StragglerDetector(self.config.straggler, clock=clock)
        self._trace = TraceWriter(self.config.straggler_trace_dir) if self.config.straggler_trace_dir else None
        self._comm = CommRegressionWatch(lambda incident: self._actions.record(incident), node=node, clock=clock,
                                         wall=wall, config=self.config.comm_regression, cluster=cluster)
        self._acting: dict[str, tuple[Incident | None, float]] = {}  # job -> hang incident waiting for progress (None: another node's)
        self._straggler_incidents = StragglerIncidents(actions, node=node, config=self.config.straggler, wall=wall,
                                                       set_flag=lambda *flag: job_telemetry.set_flag(*flag),
                                                       links_suspect=self._comm.detector.links_suspect)
        self._step_s: dict[str, float] = {}  # last median step time per job
        self._pacer = ReadPacer(actions, period_s=self.config.quiet_read_period_s, after_s=self.config.quiet_after_s,
                                clock=clock, send_s=self.config.quiet_step_send_s)
        self._stand_downs = StandDowns()
        self._lock = threading.Lock()
        self._published: tuple[dict, dict] = ({}, {})  # (job -> HangCheck, job -> {rank: RankScore})
        self.errors = 0
        self._thread: threading.Thread | None = None
        self._heartbeat = Heartbeat("watchdog loop", stall_s=STALL_S, clock=clock)

    # ---- lifecycle -----------------------------------------------------------------------------------

    @property
    def link_check(self):
        """``localize(job, on_done)``: how a communication regression asks for a link check (None: it
        does not; agent/watchdog/comm_watch.py)."""
        return self._comm.localize

    @link_check.setter
    def link_check(self, localize) -> None:
        self._comm.localize = localize

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("watchdog already started")
        self._stop.clear()
        self._heartbeat.beat()
        self._thread = threading.Thread(target=self._run, name="trainwarden-watchdog", daemon=True)
        self._thread.start()

    def liveness(self) -> str | None:
        """None while the loop runs and finishes iterations; else what is wrong, in one line."""
        thread = self._thread
        return self._heartbeat.problem(running=thread is not None and thread.is_alive())

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the loop; True when the thread ended within `timeout`."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return True
        thread.join(timeout)
        if not thread.is_alive():
            self._straggler_incidents.close(None, "the agent stopped while the rank was flagged")
            self._comm.close_all("the agent stopped during the regression (this node left the job, or the run ended)")
        return not thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.check_once()
            except Exception:
                self.errors += 1
                log.exception("watchdog iteration failed; continuing")
            self._heartbeat.beat()
            self._stop.wait(self.config.interval_s)

    def stand_down(self, job: str, why: str) -> None:
        """The job's launcher stops its workers on purpose: no hang of this worker round (agent/watchdog/stand_down.py).
        Called from the launcher's thread."""
        self._stand_downs.add(job, why)

    # ---- one iteration -------------------------------------------------------------------------------

    def check_once(self) -> None:
        """Check every job once (the loop's body; tests call it directly)."""
        checks: dict[str, HangCheck] = {}
        for snap in self._job_telemetry.snapshot():
            try:
                checks[snap.job] = self._check_job(snap)
            except Exception:
                self.errors += 1
                log.exception("watchdog check of job %s failed; continuing", snap.job, extra={"job": snap.job})
        for job in set(self._hang.jobs()) - set(checks):
            self._straggler_incidents.close(job, "the job ended while the rank was flagged")
            self._hang.forget(job)
            self._straggler.forget(job)
            self._comm.forget(job)
            self._step_s.pop(job, None)
            self._acting.pop(job, None)
            self._pacer.forget(job)
            self._stand_downs.forget(job)
            if self._cluster is not None:
                self._cluster.forget(job)
        with self._lock:
            self._published = (checks, self._straggler.scores())

    def _check_job(self, snap: JobSnapshot) -> HangCheck:
        connected = [r for r in snap.ranks if r.connected]
        in_stage = [r for r in connected if r.checkpoint_stage in BLOCKING_CHECKPOINT_STAGES]
        checkpoint_io = {}
        for r in in_stage:  # a save or restore that keeps reading or writing is not hung, however long
            moved = self._activity.io_bytes(r.pid) if r.pid > 0 else None
            if moved is not None:
                checkpoint_io[r.rank] = moved
        # every connected rank held at a step boundary for a membership change: the pause is the launcher's
        # (it restarts them once the checkpoint is committed), not a hang; the clock stops as for no ranks
        held = all(r.checkpoint_stage == "held" for r in connected)
        newest = max((r.last_step_end_unix for r in snap.ranks), default=0.0)
        newest_collective = max((r.last_collective_unix for r in snap.ranks), default=0.0)
        round_id = tuple(sorted((r.rank, r.pid) for r in snap.ranks))
        stood_down = self._stand_downs.why(snap.job, round_id) is not None  # its clock pauses as for no ranks
        step_p99 = _steady_step_p99(connected)
        # a rank's steps come late only when it holds them (its batches promise the next, or it said they stopped)
        holding = any(r.steps_promised or r.steps_stopped for r in connected)
        step_report_s = self._pacer.step_report_s(snap.job, step_p99) if holding else 0.0
        collective_report_s = self._pacer.collective_report_s(snap.job)
        check = self._hang.observe(
            snap.job, round_id=round_id,
            step_counts={r.rank: r.step_count for r in snap.ranks},
            step_p99_s=step_p99,
            in_checkpoint=bool(in_stage), running=bool(connected) and not held and not stood_down,
            checkpoint_io=checkpoint_io,
            progress_age_s=self._report_age(newest, step_report_s),
            steps_flowing=self._steps_flowing(connected),
            collective_counts={r.rank: r.collectives_seen for r in snap.ranks},
            collective_gap_s=max((r.collective_gap_max_seconds for r in connected), default=0.0),
            collective_age_s=self._report_age(newest_collective, collective_report_s),
            collective_report_s=collective_report_s,
            **(self._activity.read(connected) if self._hang.stalled_s(snap.job) >= ACTIVITY_AFTER_S else {}))
        if self._cluster is not None:
            check = self._cluster.with_other_nodes(snap.job, check)
        if check.progressed and snap.job in self._acting:
            self._resolve_hang(snap)
        if check.hung:
            self._on_hang(snap, check)
        if self._late is not None and (amended := self._late.check(snap.job)) is not None:
            acting = self._acting.get(snap.job)
            if acting is not None and acting[0] is not None and acting[0].id == amended.id:
                self._acting[snap.job] = (amended, acting[1])  # its resolution carries the late culprit
        self._comm.check(snap)
        step_times = sorted(r.step_p50_seconds for r in connected if r.step_p50_seconds > 0)
        step_s = step_times[len(step_times) // 2] if step_times else 0.0
        if step_s > 0:
            self._step_s[snap.job] = step_s
        else:  # the ranks have gone (the job ended): their last data still counts, at the last step time
            step_s = self._step_s.get(snap.job, 0.0)
        intervals = self._job_telemetry.take_intervals(snap.job)
        groups = snap.pipeline_stages()
        warm = check.min_steps_since_start >= self.config.straggler.warmup_steps
        if self._trace is not None:
            self._trace.write(snap.job, t=self._clock(), step_s=step_s, groups=groups, warm=warm, intervals=intervals,
                              totals={r.rank: [r.step_count, round(r.step_seconds_total, 6),
                                               round(sum(c.wait_seconds for c in r.collectives), 6),
                                               sum(c.count for c in r.collectives), r.checkpoint_stage, r.pid]
                                      for r in snap.ranks if r.connected})
        if not warm:
            intervals = {}  # start-up of a worker round (first steps, restore) is not a straggler's doing
            self._straggler.new_round(snap.job)
        events = self._straggler.update(snap.job, intervals, step_seconds=step_s, groups=groups)
        for event in events:
            self._straggler_incidents.on_event(snap, event)
        for rank, score in self._straggler.scores().get(snap.job, {}).items():
            self._job_telemetry.set_straggler_score(snap.job, rank, score.score)
        self._pacer.pace(snap, near_decision=self._straggler.near_decision(snap.job)
                         or self._comm.detector.near_decision(snap.job))
        return check

    def _steps_flowing(self, connected: Sequence[RankSnapshot]) -> bool:
        """Some rank keeps its promise of the next batch of steps and none said its steps stopped: they go on, though
        the newest one heard of may be a few seconds old (runtime/send_pace.py). A rank whose promised batch is
        overdue may be frozen, and a frozen sender cannot withdraw its promise: when its process is stopped
        (SIGSTOP, a debugger) the steps do not go on. Asked only then, so a job that progresses costs nothing; without
        it a job whose every rank is stopped (one rank, or each node's all) was judged only when the promises lapsed,
        twice their time after the last batch."""
        if not any(r.steps_promised for r in connected) or any(r.steps_stopped for r in connected):
            return False
        return not any(r.steps_overdue and r.pid > 0 and self._probe(r.pid) == "stopped" for r in connected)

    def _report_age(self, unix: float, report_s: float) -> float:
        """How long before now a reported event happened (0 when unknown), at most the longest its report can take
        (`report_s`, ``REPORT_AGE_CAP_S`` at least): clocks may disagree."""
        return min(max(REPORT_AGE_CAP_S, report_s), max(0.0, self._wall() - unix)) if unix else 0.0

    # ---- hang ----------------------------------------------------------------------------------------

    def _on_hang(self, snap: JobSnapshot, check: HangCheck) -> None:
        job, detected = snap.job, self._wall()
        incident_id = new_incident_id(detected)
        directory = Path(self._diagnostics_dir(job)) / incident_id
        connected = [r.rank for r in snap.ranks if r.connected]
        log.error("job %s hung: no %s for %.1f s (deadline %.1f s, %s); collecting diagnostics", job,
                  check.silent, check.stalled_s, check.timeout_s, check.reason, extra={"job": job, "incident": incident_id})
        owner = self._owner_uid(job)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            give_to_writers(directory, owner)
            reached = list(self._actions.request_diagnostics(job, connected, directory))
        except Exception:
            log.exception("requesting diagnostics for job %s failed", job, extra={"job": job})
            reached = []
        evidence = self._collect(directory, reached, {r.rank: r.pid for r in snap.ranks}, owner)
        for r in snap.ranks:
            if r.rank not in evidence:
                # the process says more than the stream: a SIGSTOPped rank's stream may have been dropped
                status = self._probe(r.pid) if r.pid > 0 else "no_answer"
                if not r.connected and status not in ("stopped", "dead"):
                    status = "disconnected"
                evidence[r.rank] = RankEvidence(rank=r.rank, status=status)
        stood_down = self._stand_downs.why(job)
        if stood_down is not None:  # the launcher began stopping the workers while their diagnostics were read
            log.info("job %s: not recording its stall as a hang: its launcher stops the workers on purpose (%s)",
                     job, stood_down, extra={"job": job, "incident": incident_id})
            return
        verdict = name_culprit(evidence)
        ranks = [r.rank for r in snap.ranks]
        culprits, summary, cluster = tuple(verdict.culprits) or tuple(verdict.unresponsive), verdict.summary, None
        early: list[tuple[bool, str]] = []  # the abort made while this node, the owner, waited for verdicts

        def abort_while_waiting(so_far: dict[str, dict]) -> None:
            if self.config.abort_on_hang:
                _, partial = merge_verdicts(so_far) if so_far else ({}, verdict.summary)
                early.append(self._abort_workers(job, ranks, f"{check.words}; {partial} (other nodes' verdicts "
                                                             "awaited)"))

        if self._cluster is not None:
            shared = self._cluster.share(snap, incident_id, verdict, abort_while_waiting)
            if shared is None:  # another node records this hang: abort our part of the group, nothing else
                return self._abort_only(snap, ranks, check, verdict)
            if shared:
                named, summary, cluster = self._cluster.evidence(shared)
                culprits = tuple(sorted(named)) or culprits
        incident = self._actions.record(Incident(  # ranks: the culprits, else those that did not answer
            id=incident_id, kind=IncidentKind.HANG, job=job, node=self._node,
            ranks=culprits,
            detected_at=detected, updated_at=detected, evidence={
                "stalled_seconds": round(check.stalled_s, 3), "timeout_seconds": round(check.timeout_s, 3),
                "deadline": check.reason, "steps_since_start": check.steps_since_start,
                "last_steps": {str(r.rank): r.last_step for r in snap.ranks},
                "checkpoint_stages": {str(r.rank): r.checkpoint_stage for r in snap.ranks},
                "connected": {str(r.rank): r.connected for r in snap.ranks},
                # ranks still inside one call with a collective in flight: seconds it has been in flight
                "waiting_in_collective": {str(r.rank): round(r.collective_pending_seconds, 1) for r in snap.ranks
                                          if waits(r)},
                "diagnostics_dir": str(directory), "verdict": verdict.to_dict(),
                **({"cluster": cluster, "summary": summary} if cluster else {})}))
        for rank in verdict.culprits:
            self._job_telemetry.set_flag(job, rank, "hung", True)
        if cluster and cluster.get("silent_nodes") and self._late is not None:  # a verdict may still come
            self._late.await_(incident, hang_key(snap), cluster["silent_nodes"], cluster["verdicts"])
        if not self.config.abort_on_hang:
            return
        incident = self._actions.record(incident.transition(
            IncidentState.ACTING, action=f"abort local workers (ranks {','.join(map(str, ranks))})",
            outcome="waiting for the job to progress after the restart", now=self._wall()))
        if self._late is not None:
            self._late.updated(incident)
        # already done while the verdicts were awaited, or now
        aborted, error = early[0] if early else self._abort_workers(
            job, ranks, f"{check.words}; {summary}")
        if aborted:
            self._acting[job] = (incident, self._clock())
        else:
            failure = "aborting the workers failed" + (f": {error}" if error else "")
            failed = self._actions.record(incident.transition(IncidentState.FAILED, outcome=failure,
                                                              now=self._wall()))
            if self._late is not None:
                self._late.updated(failed)

    def _abort_only(self, snap: JobSnapshot, ranks: list[int], check: HangCheck, verdict) -> None:
        if not self.config.abort_on_hang:
            return
        aborted, _ = self._abort_workers(snap.job, ranks, f"{check.words}; recorded by another node "
                                                          f"({verdict.summary})")
        if aborted:
            self._acting[snap.job] = (None, self._clock())

    def _abort_workers(self, job: str, ranks: list[int], reason: str) -> tuple[bool, str]:
        """Have this node's workers of ``job`` aborted: (whether they were, the error if asking raised)."""
        try:
            return bool(self._actions.abort(job, ranks, reason)), ""
        except Exception as exc:
            log.exception("aborting the workers of job %s failed", job, extra={"job": job})
            return False, repr(exc)

    def _owner_uid(self, job: str) -> int | None:
        owner = getattr(self._job_telemetry, "owner_uid", None)
        return owner(job) if owner is not None else None

    def _collect(self, directory: Path, ranks: list[int], pids: Mapping[int, int],
                 owner: int | None = None) -> dict[int, RankEvidence]:
        """The dumps of `ranks`, waiting up to `diagnostics_wait_s` for them; a rank whose process is stopped
        (SIGSTOP, a debugger) or dead can never answer, so the wait ends once only such ranks are silent (it
        delayed the incident of a stopped rank by the whole wait: BENCHMARKS.md, auto-instrumentation)."""
        deadline = self._clock() + self.config.diagnostics_wait_s
        while ranks and self._clock() < deadline and not self._stop.is_set():
            # a rank writes its stacks, then its trace, each under a temporary name renamed when complete: once
            # the trace is there, both are whole (waiting 0.1 s more for "the last writes" cost every hang that)
            silent = [r for r in ranks if not os.path.lexists(directory / trace_file(r))]
            if not silent or all(pids.get(r, 0) > 0 and self._probe(pids[r]) in ("stopped", "dead") for r in silent):
                break
            self._sleep(_POLL_S)
        # the workers wrote them: only regular files of the job's uid (ours when no stream was verified) are read
        return read_diagnostics(directory, ranks, uid=os.geteuid() if owner is None else owner)

    def _resolve_hang(self, snap: JobSnapshot) -> None:
        incident, aborted_at = self._acting.pop(snap.job)
        if incident is None:  # another node's incident: that node resolves it
            return
        for rank in incident.ranks:
            self._job_telemetry.set_flag(snap.job, rank, "hung", False)
        resolved = self._actions.record(incident.transition(
            IncidentState.RESOLVED, now=self._wall(),
            outcome=f"job progressed again {self._clock() - aborted_at:.1f} s after the abort"))
        if self._late is not None:
            self._late.updated(resolved)

    # ---- stragglers ----------------------------------------------------------------------------------

    # ---- metrics -------------------------------------------------------------------------------------

    @property
    def read_pace(self) -> dict[str, float]:
        """job -> the read period its workers are asked for (0: their own; exported)."""
        return self._pacer.read_pace

    @property
    def send_pace(self) -> dict[str, float]:
        """job -> how long its workers are asked to hold back steps that keep ending (0: not at all; exported)."""
        return self._pacer.send_pace

    @property
    def suppressed(self) -> dict[str, int]:
        """job -> straggler incidents not recorded (exported)."""
        return self._straggler_incidents.suppressed

    def collector(self) -> Collector:
        from trainwarden.agent.watchdog.exposition import WatchdogCollector

        return WatchdogCollector(self)

    @property
    def node(self) -> str:
        return self._node

    def published(self) -> tuple[dict, dict]:
        """What the last check found, for the metrics: (job -> HangCheck, job -> {rank: RankScore})."""
        with self._lock:
            return self._published

    def comm_metrics(self, checks: Mapping) -> Iterator[Metric]:
        """The communication-regression watch's metric families."""
        yield from self._comm.metrics(checks)


def _steady_step_p99(connected: Sequence[RankSnapshot]) -> float:
    """The step time the hang deadline follows: the largest steady p99 of the ranks that reported steady steps,
    or, while none has, of every rank (their start-up steps: a job whose every step is long). A stopped rank's
    telemetry stops with it, the steps of its last flush interval never arrive: stopped early in a round, it
    has reported only its start-up steps, which must not stretch the deadline the others' steps give. Steps that
    overlapped a checkpoint write are not in the steady window: they count only while a write may slow the step
    in flight (`RankSnapshot.write_pending`)."""
    steady = [r.steady_step_p99_seconds for r in connected if r.steady_steps >= STARTUP_STEPS]
    p99 = max(steady or [r.steady_step_p99_seconds for r in connected], default=0.0)
    if any(r.write_pending for r in connected):  # a checkpoint write slows the steps it overlaps: allow for them
        p99 = max(p99, max((r.writing_step_p99_seconds for r in connected), default=0.0))
    return p99

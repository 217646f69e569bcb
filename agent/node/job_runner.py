"""The node daemon's job control: it starts this node's part of every submitted job that targets it, keeps its
node record in etcd, and survives its own death without touching a job.

Each round (``reconcile_once``) the runner decides from its copy of the jobs in etcd (agent/etcd/jobs.py). A submitted job
(``managed``) whose ``nodes`` include this node (or name none), in a live phase, not asked to stop, gets one
launcher on this node unless the node is cordoned: ``trainwarden run --managed --node NODE --etcd ...`` with the
job's arguments, in a session of its own (so neither a signal to the daemon's process group nor the daemon's death
reaches it), its output in ``<state home>/daemon/logs/<job>.log``. The launcher's pid and start time go to
``<state home>/daemon/launchers/<job>.json`` (agent/node/launcher_records.py).

**Watching, not polling** (issue 28). The runner decides from a copy of the jobs and the cordon that etcd watches
keep up to date (agent/node/watched_jobs.py), so a quiet fleet costs etcd next to nothing however many nodes it has;
an event wakes the loop at once. Local work (reaping launchers, the GPU health check) still runs every
``interval_s``. The node record (agent/node/node_record.py) is put when it changes and otherwise only its lease is
kept alive (every ``NODE_RECORD_KEEPALIVE_S``).

**Re-adoption.** A daemon that starts (after a crash, a SIGKILL, an upgrade) reads those files and adopts every
launcher whose pid still has the recorded start time: it is watched, stopped on request, never launched twice.
A stale file (the pid is gone or belongs to another process now) is removed; if its job is still live in the
same generation (the node lost power, or everything on it was killed), this node's part starts again from the
job's checkpoints, counted against ``max_restarts`` as a killed launcher is. The launchers are full
`trainwarden run` supervisors with their own node agent, so their workers' telemetry, watchdog and checkpoints
never pass through the daemon: its death costs the job nothing.

**Refusals.** A job this node cannot run (its spec in etcd does not parse; its script, package or checkpoint
directory is missing here) is refused once per generation and spec revision (agent/node/job_refusal.py): one
``job_refused`` incident, and a pending generation becomes ``refused`` with the reason; nothing is retried per round.

**Exits and restarts.** A launcher that exits on its own ends this node's part of that generation: the job's
phase in etcd says how it went, and it is not started again unless the operator resumes the job (a new
generation). One killed by a signal the daemon did not send (the OOM killer, an operator's kill) is started again
while the job is live, at most ``max_restarts`` times per generation.

**Drain.** ``trainwarden drain NODE`` cordons the node with ``drain: true``; the runner sends SIGUSR1 to each of its
launchers, which leaves its job after a checkpoint at an agreed step (no step lost; the job goes on without the
node). Once uncordoned, the node takes its part in those jobs again (the job grows back).

**Stop.** ``trainwarden stop JOB`` writes ``jobs/<job>/control``; the runner sends SIGTERM to its launcher, which
stops the workers and records the job ``stopped``. SIGTERM to the daemon itself stops only the daemon.

**etcd away.** A read that fails is logged once and retried next round (the watches die with the connection); nothing is started or stopped meanwhile,
and the node record is written again (under a fresh lease if the old one lapsed) when etcd answers.

**Liveness.** Each round beats a ``Heartbeat``; ``liveness()`` reports a loop that has ended or finished no round
for ``STALL_S``, and the daemon then stops its systemd keep-alives (agent/node/liveness.py): systemd restarts the
daemon, and the new one adopts the launchers.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import psutil
from prometheus_client.core import GaugeMetricFamily, Metric

from trainwarden.agent.common.heartbeat import Heartbeat
from trainwarden.agent.common.job_lifecycle import JobPhase
from trainwarden.agent.common.job_spec import JobSpecError
from trainwarden.agent.etcd.client import describe_etcd_error
from trainwarden.agent.etcd.jobs import JobControl, JobView
from trainwarden.agent.incidents.record import Incident
from trainwarden.agent.common.paths import job_state_dir
from trainwarden.agent.node.job_refusal import JobRefusals, node_problems
from trainwarden.agent.node import job_user
from trainwarden.agent.node.launcher_records import LauncherFiles, LauncherRecord, alive
from trainwarden.agent.node.node_cordon import NodeCordon
from trainwarden.agent.node.node_record import NODE_RECORD_KEEPALIVE_S, NODE_RECORD_TTL_S, NodeRecord
from trainwarden.agent.node.watched_jobs import LIVE_PHASES, SAFETY_REREAD_S, WatchedJobs

logger = logging.getLogger(__name__)

__all__ = ["JobRunner", "LauncherRecord", "NODE_RECORD_KEEPALIVE_S", "NODE_RECORD_TTL_S", "SAFETY_REREAD_S",
           "STALL_S"]

STALL_S = 120.0
"""A round that has not finished after this long is wedged: a slow one makes a few etcd calls, each bounded by the
client's timeout and retried once on each other member, and starts a few processes."""


class JobRunner:
    """Starts, adopts, watches and stops this node's launchers (module docstring)."""

    def __init__(self, client, *, node: str, etcd: str, state_home: Path, etcd_args: list[str] | None = None,
                 local_addr: str | None = None, endpoints: dict | None = None, interval_s: float = 2.0,
                 python: str = sys.executable, gpus: Callable[[], int] | None = None,
                 health: Callable[[], tuple[str, ...]] | None = None,
                 record: Callable[[Incident], Incident] | None = None,
                 clock: Callable[[], float] = time.monotonic, default_user: str | None = None,
                 allow_root_jobs: bool = False, etcd_files: tuple[str, ...] = (), lineage=None,
                 job_users: dict | None = None, identities=None) -> None:
        """``health()``: why this node's GPUs should not train (empty when they are fit; the GPU sampler's
        ``unhealthy_reasons``); a reason drains the node. ``record``: where cordon incidents go. ``clock``: the
        heartbeat's. ``default_user``, ``allow_root_jobs``: who jobs run as (agent/node/job_user.py), and
        ``job_users`` who may (``resolve_job_user``'s ``users``, ``groups``, ``privileged_groups``);
        ``etcd_files``: the etcd credential files the launchers are given, which their user must be able to read.
        ``lineage``: the daemon's ``AgentActions``; each launcher is registered there, so that only its own
        processes may stream to the daemon's socket as its job (``register_launcher``/``forget_launcher``).
        ``identities``: a ``JobEtcdIdentities`` that gives each launcher an etcd user of its own instead of
        ``etcd_args``' credential (agent/node/job_etcd_identity.py); None: ``etcd_args`` as they are."""
        self._client, self._control = client, JobControl(client)
        self.node, self._etcd, self._etcd_args = node, etcd, list(etcd_args or [])
        self._home = Path(state_home)
        self._dir = self._home / "daemon"
        self._local_addr, self._endpoints = local_addr, dict(endpoints or {})
        self._interval, self._python = interval_s, python
        self._default_user, self._allow_root, self._etcd_files = default_user, allow_root_jobs, tuple(etcd_files)
        self._lineage, self._identities = lineage, identities
        self._who = dict(job_users or {})
        self._cordon = NodeCordon(self._control, node=node, health=health, record=record)  # node_cordon.py
        self._launchers: dict[str, LauncherRecord] = {}
        self._files = LauncherFiles(self._dir / "launchers")
        self._phases: dict[str, tuple[int, str]] = {}  # job -> (generation, phase) of the jobs targeting this node
        self._phases_next: dict[str, tuple[int, str]] = {}
        self._children: dict[int, subprocess.Popen] = {}  # launchers this daemon process started (exit codes)
        self._finished: dict[str, int] = {}  # job -> the generation this node's part of ended in
        self._lapsed: dict[str, LauncherRecord] = {}  # launchers that ended while the daemon was away: judged once
        self._terminated: set[int] = set()  # pids this daemon asked to stop
        self._draining: set[int] = set()  # pids this daemon asked to leave their job (a drain)
        self._node_record = NodeRecord(client, self._control, node=node, address=local_addr,
                                       endpoints=self._endpoints, gpus=gpus, clock=clock)
        self._failing = False
        self._jobs = WatchedJobs(client, self._control, node=node, clock=clock)  # what etcd holds, watched
        self._clock = clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainwarden-jobs", daemon=True)
        self._heartbeat = Heartbeat("job runner", stall_s=STALL_S, clock=clock)
        self._refusals = JobRefusals(self._control, node=node, path=self._dir / "refused.json", record=record)
        self.adopted: list[str] = []

    # ---- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        self._files.directory.mkdir(parents=True, exist_ok=True)
        (self._dir / "logs").mkdir(parents=True, exist_ok=True)
        self._adopt()
        if self._identities is not None:
            self._identities.sweep({job: rec.generation for job, rec in self._launchers.items()})
        self._heartbeat.beat()
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> list[str]:
        """Stop watching (the launchers go on); the jobs still running on this node."""
        self._stop.set()
        self._jobs.wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._jobs.stop()
        self._node_record.revoke()
        return sorted(job for job, rec in self._launchers.items() if alive(rec))

    def launchers(self) -> dict[str, LauncherRecord]:
        return dict(self._launchers)

    def liveness(self) -> str | None:
        """None while the loop runs and finishes rounds; else what is wrong, in one line."""
        return self._heartbeat.problem(running=self._thread.is_alive())

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.reconcile_once()
            except Exception:  # one bad round (a launch that cannot write its log) must not end the loop
                logger.exception("reconciling this node's jobs failed; trying again next round")
            self._heartbeat.beat()
            self._jobs.wake.wait(self._interval)  # a watch event wakes it at once

    # ---- one round ------------------------------------------------------------------------------------

    def reconcile_once(self) -> None:
        jobs = self._jobs
        jobs.wake.clear()
        self._reap()
        try:
            jobs.refresh()
            views = [jobs.views[name] for name in sorted(jobs.views)]
            cordon = jobs.cordon
            if cordon is None:
                cordon = jobs.cordon = self._cordon.if_unfit()
        except Exception as exc:
            jobs.resync_due = True
            if not self._failing:
                logger.warning("cannot read the jobs from etcd (%s); the jobs on this node keep running, nothing is "
                               "started or stopped until etcd answers", describe_etcd_error(exc))
            self._failing = True
            return
        if self._failing:
            logger.info("etcd answers again; reconciling this node's jobs")
        self._failing = False
        self._phases_next = {}
        for view in views:
            try:
                self._reconcile_job(view, cordoned=cordon is not None)
            except Exception:
                logger.exception("job %s: reconciling failed; trying again next round", view.name)
        self._phases = self._phases_next
        self._cordon.note(cordon, self._launchers)
        if cordon is not None and cordon.get("drain"):
            for rec in list(self._launchers.values()):
                if rec.pid not in self._draining and rec.pid not in self._terminated:
                    self._draining.add(rec.pid)
                    self._signal(rec, signal.SIGUSR1, f"node drained: {cordon.get('reason', '')}")
        self._publish_node(cordon)

    def _reconcile_job(self, view: JobView, *, cordoned: bool) -> None:
        if not view.managed:
            return
        rec = self._launchers.get(view.name)
        if rec is not None:  # running here: watched and stopped on request, whatever its spec says now
            self._phases_next[view.name] = (view.generation, view.phase)
            if view.stop_requested and rec.pid not in self._terminated:
                self._terminate(rec, f"stop requested by {(view.control or {}).get('by', '?')}")
            return
        live = view.phase in LIVE_PHASES and not view.stop_requested
        try:
            spec = view.job_spec()
        except JobSpecError as exc:  # the same validation as `submit`: a hand-edited record, or a newer field
            if live:
                self._refuse(view, f"its spec in etcd is not usable: {exc}")
            return
        if not spec.targets(self.node):
            return
        self._phases_next[view.name] = (view.generation, view.phase)
        relaunches = self._lapsed_launcher(view, spec, live=live)
        if not live or self._finished.get(view.name) == view.generation or self._refusals.refused(view):
            return
        if cordoned:
            logger.info("job %s wants this node, but it is cordoned: not starting it", view.name)
            return
        user = self._user_for(view, spec)
        if user is None:
            return
        problems = node_problems(spec, user=user, python=self._python)  # as the user sees the node (issue 44)
        if problems:
            self._refuse(view, "; ".join(problems))
            return
        self._launch(view, spec, user, relaunches=relaunches)

    def _lapsed_launcher(self, view: JobView, spec, *, live: bool) -> int:
        """A launcher of this job that ended while the daemon was away (a power loss, a kill of the whole node): its
        exit code is unknown. While the job is still live in the same generation, this node's part starts again, as
        for a launcher killed under a running daemon (``max_restarts`` per generation, counted on); the restarts
        spent so far are returned. Otherwise (the job ended, a new generation, the budget spent) this node's part of
        that generation is over."""
        rec = self._lapsed.pop(view.name, None)
        if rec is None:
            return 0
        if live and view.generation == rec.generation and rec.relaunches < spec.max_restarts:
            logger.warning("job %s generation %d: its launcher (pid %d) ended while the daemon was away and the job "
                           "is still %s; starting it again (%d of %d)", view.name, rec.generation, rec.pid,
                           view.phase, rec.relaunches + 1, spec.max_restarts)
            return rec.relaunches + 1
        spent = live and view.generation == rec.generation  # the job goes on without this node: say it louder
        why = f"its {spec.max_restarts} restart(s) on this node are spent" if spent else \
            f"the job is {view.phase} (generation {view.generation})"
        logger.log(logging.WARNING if spent else logging.INFO, "job %s: its launcher (pid %d) ended while the daemon "
                   "was away; %s, so this node's part of generation %d is over", view.name, rec.pid, why,
                   rec.generation)
        self._finished[view.name] = rec.generation
        return 0

    def _user_for(self, view: JobView, spec) -> job_user.JobUser | None:
        """Who runs ``spec`` on this node; None, after refusing the job, when no one may."""
        try:
            user = job_user.resolve_job_user(spec.user, default=self._default_user, allow_root=self._allow_root,
                                             **self._who)
        except job_user.JobUserRefused as exc:
            self._refuse(view, str(exc))
            return None
        problems = []
        if spec.checkpoint_dir and not job_user.writable_by(spec.checkpoint_dir, user):
            problems.append(f"checkpoint_dir {spec.checkpoint_dir!r} is not writable by {user}: make it the user's "
                            "(chown) or writable by one of its groups")
        problems += [f"the etcd credential file {path} is not readable by {user}, whom the job's launcher runs as: "
                     "make it readable by a group of that user" for path in self._etcd_files
                     if not job_user.readable_by(path, user)]
        if problems:
            self._refuse(view, "; ".join(problems))
            return None
        return user

    def _refuse(self, view: JobView, why: str) -> None:
        """Refuse on this node; whether the whole generation is refused depends on its members, read only now."""
        if not self._refusals.refused(view) and not view.nodes:
            view.nodes = self._control.members(view.name)
        self._refusals.refuse(view, why)

    # ---- metrics ---------------------------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        """``trainwarden_node_cordoned{node, kind}`` (1 while cordoned; kind ``cordon`` or ``drain``, 0 under both
        when in service), ``trainwarden_node_jobs{node}`` (launchers running here) and
        ``trainwarden_job_phase{job, generation, phase}`` (what the alerts on failed jobs read); a prometheus_client
        collector, registered on the daemon's exporter."""
        yield self._cordon.metric()
        jobs = GaugeMetricFamily("trainwarden_node_jobs", "Jobs whose launcher runs on this node (started or adopted "
                                 "by the daemon)", labels=["node"])
        jobs.add_metric([self.node], float(len(self._launchers)))
        yield jobs
        phase = GaugeMetricFamily("trainwarden_job_phase", "1 for the phase the submitted job is in (as the daemon "
                                  "last read it from etcd), 0 for the others; jobs that target this node",
                                  labels=["job", "generation", "phase"])
        for name, (generation, current) in sorted(self._phases.items()):
            for p in JobPhase:
                phase.add_metric([name, str(generation), p.value], 1.0 if p.value == current else 0.0)
        yield phase

    # ---- launchers ------------------------------------------------------------------------------------

    def _launch(self, view: JobView, spec, user: job_user.JobUser, relaunches: int = 0) -> None:
        log_path = self._dir / "logs" / f"{view.name}.log"
        identity = job_user.launch_identity(user, dict(os.environ))
        state = job_state_dir(view.name, self._home)
        if identity.switches and (why := job_user.state_dir_problem(state, user)) is not None:
            self._refuse(view, why)
            return
        with open(os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o640), "ab") as log:
            try:
                state.mkdir(parents=True, exist_ok=True)
                if identity.switches:  # the job's state directory and its log are its user's
                    job_user.hand_over(state, user, under=self._home)
                    if os.fstat(log.fileno()).st_nlink == 1:
                        os.fchown(log.fileno(), user.uid, user.gid)
            except OSError as exc:  # a refusal, never an exception every round (issue 44)
                self._refuse(view, f"its state directory cannot be given to {user}: {exc.strerror or exc}")
                return
            try:  # the launcher's own etcd user, or the daemon's flags
                etcd_args = self._identities.grant(view.name, view.generation, user.uid, user.gid) \
                    if self._identities is not None else self._etcd_args
            except Exception as exc:  # etcd away: the next round tries again
                logger.warning("job %s: %s; trying again next round", view.name, exc)
                return
            log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} node {self.node} starts job {view.name} "
                      f"generation {view.generation} as {user}\n".encode())
            log.flush()
            cmd = [self._python, "-m", "trainwarden.agent.cli", "run", "--managed", "--node", self.node,
                   "--etcd", self._etcd, *etcd_args, "--state-home", str(self._home), "--metrics-port", "0",
                   *(["--local-addr", self._local_addr] if self._local_addr else []), *spec.launcher_args()]
            # no user=/group=/preexec_fn: the Popen is a vfork, never a fork of this process's gRPC threads
            try:
                proc = subprocess.Popen(identity.argv(cmd), stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                        env=identity.env)
            except (OSError, ValueError, subprocess.SubprocessError) as exc:  # e.g. a NUL the spec should not hold
                if self._identities is not None:
                    self._identities.revoke(view.name, view.generation)
                self._refuse(view, f"its launcher cannot be started: {exc}")
                return
        try:
            started = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            started = 0.0
        rec = LauncherRecord(job=view.name, generation=view.generation, pid=proc.pid, started=started,
                             log=str(log_path), relaunches=relaunches)
        self._children[proc.pid] = proc
        self._launchers[view.name] = rec
        self._files.save(rec)
        if self._lineage is not None:
            self._lineage.register_launcher(view.name, proc.pid)
        logger.info("job %s generation %d: started its launcher on node %s as %s (pid %d, log %s)", view.name,
                    view.generation, self.node, user, proc.pid, log_path)

    def _terminate(self, rec: LauncherRecord, why: str) -> None:
        self._terminated.add(rec.pid)
        self._signal(rec, signal.SIGTERM, why)

    def _signal(self, rec: LauncherRecord, sig: int, why: str) -> None:
        """``sig`` to a launcher this daemon started or adopted, if it is still that process: SIGTERM stops the
        job on this node, SIGUSR1 makes it leave the job after a checkpoint (agent/launch/run.py)."""
        try:
            proc = psutil.Process(rec.pid)
            if abs(proc.create_time() - rec.started) > 0.01:
                return
            proc.send_signal(sig)  # psutil refuses a pid that was reused meanwhile
            what = "stop" if sig == signal.SIGTERM else "leave the job"
            logger.info("job %s: asked its launcher (pid %d) to %s (%s)", rec.job, rec.pid, what, why)
        except psutil.Error:
            pass

    def _reap(self) -> None:
        """Launchers that ended: forget them (and their etcd user); one killed by a signal nobody here sent starts
        again."""
        if self._identities is not None:
            self._identities.retry()
        for job, rec in list(self._launchers.items()):
            child = self._children.get(rec.pid)
            rc = child.poll() if child is not None else None
            if child is not None and rc is None:
                continue
            if child is None and alive(rec):
                continue
            self._children.pop(rec.pid, None)
            del self._launchers[job]
            self._files.forget(job)
            if self._identities is not None:
                self._identities.revoke(job, rec.generation)
            if self._lineage is not None:
                self._lineage.forget_launcher(job, rec.pid)
            how = f"exited with {rc}" if rc is not None else "ended (adopted: exit code unknown)"
            logger.info("job %s generation %d: the launcher on node %s %s", job, rec.generation, self.node, how)
            killed = rc is not None and rc < 0 and rec.pid not in self._terminated
            if rec.pid in self._draining:  # left the job for a drain: back in it once the node is uncordoned
                self._draining.discard(rec.pid)
            elif killed and rec.relaunches < self._max_restarts(job):
                self._relaunch(rec)
            else:
                self._finished[job] = rec.generation

    def _relaunch(self, rec: LauncherRecord) -> None:
        try:
            view = self._control.job(rec.job)
        except Exception as exc:
            logger.warning("job %s: cannot read it from etcd to start its launcher again (%s); next round",
                           rec.job, describe_etcd_error(exc))
            return  # not finished: the next round launches it as for a new job
        if view is None or view.phase not in LIVE_PHASES or view.stop_requested or view.generation != rec.generation:
            self._finished[rec.job] = rec.generation
            return
        logger.warning("job %s: its launcher on node %s was killed; starting it again (%d of %d)", rec.job,
                       self.node, rec.relaunches + 1, self._max_restarts(rec.job))
        spec = view.job_spec()
        user = self._user_for(view, spec)
        if user is None:
            self._finished[rec.job] = rec.generation
            return
        self._launch(view, spec, user, relaunches=rec.relaunches + 1)

    def _max_restarts(self, job: str) -> int:
        try:
            view = self._control.job(job)
            return view.job_spec().max_restarts if view is not None else 0
        except Exception:
            return 0

    def _adopt(self) -> None:
        for rec in self._files.read_all():
            if alive(rec):
                self._launchers[rec.job] = rec
                self.adopted.append(rec.job)
                if self._lineage is not None:
                    self._lineage.register_launcher(rec.job, rec.pid)
                logger.info("job %s generation %d: adopted its running launcher (pid %d)", rec.job, rec.generation,
                            rec.pid)
            else:  # judged in the first round that reads the job (its phase and budget are in etcd)
                self._lapsed[rec.job] = rec
                self._files.forget(rec.job)

    def _publish_node(self, cordon: dict | None) -> None:
        if not self._node_record.publish(cordon, self._launchers):
            self._jobs.resync_due = True  # the watches likely died with the connection

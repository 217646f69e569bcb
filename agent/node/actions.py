"""What the watchdog may do on this node: talk to workers, kill the ones that cannot obey, record incidents.

``AgentActions`` is the node's implementation of the watchdog's ``WatchdogActions`` contract: diagnostics and
abort commands go over the telemetry stream; a worker that does not exit within ``ABORT_GRACE_S`` of an
abort (stopped, wedged) is SIGKILLed, held by pid and start time so a reused pid is never signalled;
incidents and exclusion requests go to the ``IncidentStore``.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import psutil
from prometheus_client.core import CounterMetricFamily, Metric

from trainwarden.agent.incidents import Incident, IncidentStore
from trainwarden.agent.shared import telemetry_pb2 as pb
from trainwarden.agent.telemetry.job_telemetry import JobTelemetry
from trainwarden.agent.telemetry.server import TelemetryServer
from trainwarden.agent.watchdog.culprit import process_state

logger = logging.getLogger(__name__)

__all__ = ["ABORT_GRACE_S", "AgentActions"]

ABORT_GRACE_S = 1.5
"""How long workers get to obey an abort command before they are killed."""



class AgentActions:
    """What the watchdog may do on this node: talk to workers, kill them, record incidents.

    A signal goes only to a process the agent owns, checked just before it is sent: the rank's pid came
    from the kernel (peer credentials, not the Hello's claim), the process at that pid still has the start
    time it had when verified, and, when the job's launcher is registered (``register_launcher``: the
    torchrun that `trainwarden run` started), it descends from that launcher. Anything else is refused,
    logged and counted (``trainwarden_signals_refused_total{reason}``).
    """

    def __init__(self, server: TelemetryServer, job_telemetry: JobTelemetry, incidents: IncidentStore, *,
                 kill: Callable[[int, int], None] | None = None, sleep: Callable[[float], None] = time.sleep,
                 node: str = "") -> None:
        self._server, self._job_telemetry, self._incidents = server, job_telemetry, incidents
        self._kill, self._sleep, self._node = kill, sleep, node
        self._killed: deque[int] = deque(maxlen=4096)  # pids this node SIGKILLed after an abort
        self._launchers: dict[str, tuple[int, float]] = {}  # job -> (pid, start time) of its launcher
        self._lock = threading.Lock()
        self.refused: dict[str, int] = {}
        self.stand_in: Callable[[int], int | None] = lambda pid: None
        """The pid the launcher knows a worker by, when that is not the worker's own: a warm worker's client
        (runtime/zygote.py; set by `trainwarden run`). A worker SIGKILLed counts as killed under both."""

    def killed_by_agent(self, pid: int) -> bool:
        """True when the agent itself SIGKILLed `pid` (a worker that could not obey an abort), or the worker
        `pid` stands in for."""
        return pid in self._killed

    def register_launcher(self, job: str, pid: int) -> None:
        """The job's workers descend from `pid` (its torchrun): only those may be signalled for it."""
        try:
            started = psutil.Process(pid).create_time()
        except psutil.Error:
            return
        with self._lock:
            self._launchers[job] = (pid, started)

    def forget_launcher(self, job: str, pid: int) -> None:
        """The launcher ``pid`` of ``job`` ended: the job's name is free for whoever streams next."""
        with self._lock:
            if self._launchers.get(job, (None,))[0] == pid:
                del self._launchers[job]

    def stream_refusal(self, info) -> str | None:
        """Why a telemetry stream may not speak for ``info.job`` (None: it may): a job whose launcher this agent
        knows (``register_launcher``: `trainwarden run`'s torchrun, or a launcher of this node's daemon) takes
        streams only from verified processes that descend from it. The TelemetryServer's ``stream_guard``."""
        with self._lock:
            launcher = self._launchers.get(info.job)
        if launcher is None:
            return None
        if not info.verified:
            return (f"job {info.job} is run by launcher pid {launcher[0]} on this node: a stream without peer "
                    "credentials cannot show it descends from it")
        try:
            proc = psutil.Process(info.pid)
        except psutil.Error:
            return f"job {info.job}: the stream's process (pid {info.pid}) is gone"
        if not _descends_from(proc, *launcher):
            return (f"job {info.job} is run by launcher pid {launcher[0]} on this node; the stream's process "
                    f"(pid {info.pid}) does not descend from it")
        return None

    def request_diagnostics(self, job: str, ranks: Sequence[int], directory: Path) -> Sequence[int]:
        command = pb.AgentCommand(dump_diagnostics=pb.DumpDiagnostics(dir=str(directory)))
        return [r for r in ranks if self._server.send_command(job, r, command)]

    def request_checkpoint(self, job: str, step: int, *, hold: bool = False) -> list[int]:
        """Ask every connected rank of ``job`` on this node to save after ``step`` (and, with ``hold``, to wait
        there for the launcher's restart); the ranks asked."""
        command = pb.AgentCommand(checkpoint_now=pb.CheckpointNow(step=int(step), hold=hold))
        ranks = [r.rank for snap in self._job_telemetry.snapshot(job) for r in snap.ranks if r.connected]
        return [r for r in sorted(ranks) if self._server.send_command(job, r, command)]

    def set_read_pace(self, job: str, ranks: Sequence[int], period_s: float, send_s: float = 0.0) -> list[int]:
        command = pb.AgentCommand(read_pace=pb.ReadPace(max_period_seconds=float(period_s),
                                                        step_send_seconds=float(send_s)))
        return [r for r in ranks if self._server.send_command(job, r, command)]

    def abort(self, job: str, ranks: Sequence[int], reason: str) -> bool:
        command = pb.AgentCommand(abort=pb.Abort(reason=reason[:500]))
        # hold each worker by (pid, start time) before asking: after the grace period a pid that exited
        # may already belong to someone else, and only the process we asked may be killed
        procs = {}
        for rank, snap in self._ranks(job, ranks).items():
            proc = self._owned(job, rank, snap)
            if proc is not None:
                procs[rank] = proc
        for rank in ranks:
            self._server.send_command(job, rank, command)
        self._sleep(ABORT_GRACE_S)
        for rank, proc in procs.items():
            if not proc.is_running() or process_state(proc.pid) == "dead":  # exited (or its pid was reused)
                continue
            logger.warning("job %s rank %d (pid %d) did not exit on abort; killing it", job, rank, proc.pid)
            self._killed.append(proc.pid)
            try:
                alias = self.stand_in(proc.pid)  # asked while the worker lives: the map goes with it
            except Exception:
                alias = None
            if alias is not None:
                self._killed.append(alias)
            try:
                if self._kill is None:
                    proc.send_signal(signal.SIGKILL)  # psutil refuses if the pid was reused meanwhile
                else:
                    self._kill(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        return True

    def _owned(self, job: str, rank: int, snap) -> psutil.Process | None:
        """The rank's process if this agent may signal it, else None (refusal logged and counted)."""
        if not snap.verified:
            return self._refuse(job, rank, snap.pid, "unverified", "its pid is the worker's claim, not the kernel's")
        try:
            proc = psutil.Process(snap.pid)
            started = proc.create_time()
        except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
            return None  # gone already: nothing to signal
        if abs(started - snap.started) > 0.01:
            return self._refuse(job, rank, snap.pid, "reused_pid", "another process has its pid now")
        with self._lock:
            launcher = self._launchers.get(job)
        if launcher is not None and not _descends_from(proc, *launcher):
            return self._refuse(job, rank, snap.pid, "not_in_job", f"it does not descend from the job's launcher "
                                f"(pid {launcher[0]})")
        return proc

    def _refuse(self, job: str, rank: int, pid: int, reason: str, why: str) -> None:
        with self._lock:
            self.refused[reason] = self.refused.get(reason, 0) + 1
        logger.error("job %s rank %d: not signalling pid %d: %s", job, rank, pid, why,
                     extra={"job": job, "rank": rank, "reason": reason})
        return None

    def record(self, incident: Incident) -> Incident:
        return self._incidents.record(incident)

    def request_exclusion(self, job: str, node: str, request: Mapping[str, Any]) -> None:
        self._incidents.request_exclusion(job, node, request)

    def withdraw_exclusion(self, job: str, node: str) -> None:
        self._incidents.withdraw_exclusion(job, node)

    def _ranks(self, job: str, ranks: Sequence[int]) -> dict[int, Any]:
        wanted = set(ranks)
        for snap in self._job_telemetry.snapshot(job):
            return {r.rank: r for r in snap.ranks if r.rank in wanted and r.pid > 0}
        return {}

    def collect(self) -> Iterator[Metric]:
        refused = CounterMetricFamily("trainwarden_signals_refused", "Signals the agent did not send because the "
                                      "target was not verifiably the job's worker.", labels=["node", "reason"])
        with self._lock:
            for reason, n in sorted(self.refused.items()):
                refused.add_metric([self._node, reason], n)
        yield refused


def _descends_from(proc: psutil.Process, pid: int, started: float) -> bool:
    try:
        for parent in proc.parents():
            if parent.pid == pid:
                return abs(parent.create_time() - started) <= 0.01
    except psutil.Error:
        return False
    return False

"""What the watchdog may do on this node: talk to workers, kill the ones that cannot obey, record incidents.

``AgentActions`` is the node's implementation of the watchdog's ``WatchdogActions`` contract: diagnostics and
abort commands go over the telemetry stream; a worker that does not exit within ``ABORT_GRACE_S`` of an
abort (stopped, wedged) is SIGKILLed, held by pid and start time so a reused pid is never signalled;
incidents and exclusion requests go to the ``IncidentStore``.
"""

from __future__ import annotations

import logging
import signal
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import psutil

from trainwarden.agent.incidents import Incident, IncidentStore
from trainwarden.agent.proto import telemetry_pb2 as pb
from trainwarden.agent.telemetry.job_telemetry import JobTelemetry
from trainwarden.agent.telemetry.server import TelemetryServer
from trainwarden.agent.watchdog.culprit import process_state

logger = logging.getLogger(__name__)

__all__ = ["ABORT_GRACE_S", "AgentActions"]

ABORT_GRACE_S = 1.5
"""How long workers get to obey an abort command before they are killed."""



class AgentActions:
    """What the watchdog may do on this node: talk to workers, kill them, record incidents."""

    def __init__(self, server: TelemetryServer, job_telemetry: JobTelemetry, incidents: IncidentStore, *,
                 kill: Callable[[int, int], None] | None = None, sleep: Callable[[float], None] = time.sleep) -> None:
        self._server, self._job_telemetry, self._incidents = server, job_telemetry, incidents
        self._kill, self._sleep = kill, sleep
        self._killed: deque[int] = deque(maxlen=4096)  # pids this node SIGKILLed after an abort

    def killed_by_agent(self, pid: int) -> bool:
        """True when the agent itself SIGKILLed `pid` (a worker that could not obey an abort)."""
        return pid in self._killed

    def request_diagnostics(self, job: str, ranks: Sequence[int], directory: Path) -> Sequence[int]:
        command = pb.AgentCommand(dump_diagnostics=pb.DumpDiagnostics(dir=str(directory)))
        return [r for r in ranks if self._server.send_command(job, r, command)]

    def abort(self, job: str, ranks: Sequence[int], reason: str) -> bool:
        command = pb.AgentCommand(abort=pb.Abort(reason=reason[:500]))
        # hold each worker by (pid, start time) before asking: after the grace period a pid that exited
        # may already belong to someone else, and only the process we asked may be killed
        procs = {}
        for rank, pid in self._pids(job, ranks).items():
            try:
                procs[rank] = psutil.Process(pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
                pass
        for rank in ranks:
            self._server.send_command(job, rank, command)
        self._sleep(ABORT_GRACE_S)
        for rank, proc in procs.items():
            if not proc.is_running() or process_state(proc.pid) == "dead":  # exited (or its pid was reused)
                continue
            logger.warning("job %s rank %d (pid %d) did not exit on abort; killing it", job, rank, proc.pid)
            self._killed.append(proc.pid)
            try:
                if self._kill is None:
                    proc.send_signal(signal.SIGKILL)  # psutil refuses if the pid was reused meanwhile
                else:
                    self._kill(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        return True

    def record(self, incident: Incident) -> Incident:
        return self._incidents.record(incident)

    def request_exclusion(self, job: str, node: str, request: Mapping[str, Any]) -> None:
        self._incidents.request_exclusion(job, node, request)

    def withdraw_exclusion(self, job: str, node: str) -> None:
        self._incidents.withdraw_exclusion(job, node)

    def _pids(self, job: str, ranks: Sequence[int]) -> dict[int, int]:
        wanted = set(ranks)
        for snap in self._job_telemetry.snapshot(job):
            return {r.rank: r.pid for r in snap.ranks if r.rank in wanted and r.pid > 0}
        return {}

"""Crash and restart incidents, read from torchrun's own reports.

torchrun prints one line per failed worker ("failed (exitcode: -9) local_rank: 5 (pid: 27998)") and,
when it has budget left, "will restart worker group". ``WorkerFailureRecorder`` turns each such round into one
incident: ``crash`` when a worker died of a signal or a non-zero exit that was not the watchdog's abort,
``restart`` otherwise (the watchdog's own hang incident already explains an abort). The incident is
``acting`` while the group restarts and ``resolved`` when steps complete again; if the restart budget is
spent, ``failed``.

torchrun names the first failure it noticed, which is often a peer the dead rank took down (rank 5 is
SIGKILLed, rank 0's next collective fails, torchrun reports "local_rank 0, exit code 1"). When the agent
is in the same process, ``ended_streams`` tells who left first and how. The rank that fails first leaves
first: its peers notice only when their next collective with it fails. A crash incident therefore names
the first rank whose telemetry stream ended (global rank), unless that rank said it was leaving because a
peer was gone (``runtime.goodbye("peer gone: ...")``: the first failure was on another node) — then
torchrun's report stands. The order and manner of every ending (said goodbye and why, or just broke, as
a rank killed by a signal does) are kept as evidence.
"""

from __future__ import annotations

import re
import signal
import socket
import time
from typing import Callable

from trainwarden.agent.proto.contract import EXIT_ABORTED, PEER_GONE
from trainwarden.agent.incidents.record import Incident, IncidentKind, IncidentState, new_incident_id

__all__ = ["WorkerFailureRecorder", "WORKER_FAILED_LINE"]

WORKER_FAILED_LINE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")


def _describe(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    if exitcode == EXIT_ABORTED:
        return "aborted by the agent"
    return f"exit code {exitcode}"


class WorkerFailureRecorder:
    def __init__(self, job: str, record: Callable[[Incident], Incident], *, node: str | None = None,
                 wall: Callable[[], float] = time.time,
                 ended_streams: Callable[[float], list[dict]] | None = None) -> None:
        self._job, self._record, self._wall = job, record, wall
        self._ended_streams = ended_streams
        self._since = wall()  # streams that ended before this belong to an earlier round
        self._node = node or socket.gethostname()
        self._failures: list[dict] = []
        self._open: Incident | None = None

    def feed(self, line: str, *, restarting: bool, step: int | None) -> None:
        """One output line; ``restarting`` when it announces a restart, ``step`` when it reports one."""
        match = WORKER_FAILED_LINE.search(line)
        if match:
            code = int(match.group(1))
            self._failures.append({"local_rank": int(match.group(2)), "pid": int(match.group(3)),
                                   "exitcode": code, "cause": _describe(code)})
        elif restarting:
            self._start(IncidentState.ACTING, "torchrun restarts the worker group")
        elif step is not None and self._open is not None:
            self._open = self._record(self._open.transition(
                IncidentState.RESOLVED, outcome=f"running again at step {step}", now=self._wall()))
            self._open = None

    def job_failed(self, reason: str) -> None:
        """The job ended failed: close the open incident, or record the final failure."""
        if self._open is not None:
            self._open = self._record(self._open.transition(IncidentState.FAILED, outcome=reason, now=self._wall()))
            self._open = None
        elif self._failures:
            self._start(IncidentState.FAILED, "none: the restart budget is spent", outcome=reason)

    def _start(self, state: IncidentState, action: str, outcome: str = "") -> None:
        if self._open is not None:  # restarted again before any step: the earlier restart did not recover
            self._record(self._open.transition(IncidentState.FAILED, outcome="failed again before a step completed",
                                               now=self._wall()))
            self._open = None
        failures, self._failures = self._failures, []
        crashed = any(f["exitcode"] not in (0, EXIT_ABORTED) for f in failures)
        now = self._wall()
        ranks = tuple(sorted({f["local_rank"] for f in failures}))
        evidence: dict = {"failed_workers": failures, "ranks_are": "local ranks on this node (torchrun's report)"}
        if crashed and self._ended_streams is not None:
            try:
                ended = self._ended_streams(self._since)
            except Exception:  # evidence only: never lose the incident over it
                ended = []
            if ended:
                evidence["telemetry_streams_ended"] = ended
                first = ended[0]
                goodbye = first["goodbye"]
                if not (goodbye or "").startswith(PEER_GONE):
                    ranks = (first["rank"],)
                    evidence["ranks_are"] = ("global rank whose telemetry stream ended first (the first to fail; "
                                             "its peers followed)")
                    how = "without a goodbye (killed by a signal or died hard)" if goodbye is None \
                        else f"saying {goodbye!r}"
                    reported = ", ".join(f"local rank {f['local_rank']} ({f['cause']})" for f in failures)
                    evidence["summary"] = (f"rank {first['rank']} failed first: its stream ended {how}, "
                                           f"{len(ended) - 1} other rank(s) followed; torchrun reported "
                                           f"{reported or 'nothing'}")
        self._since = now
        incident = Incident(
            id=new_incident_id(now), kind=IncidentKind.CRASH if crashed else IncidentKind.RESTART,
            job=self._job, node=self._node, ranks=ranks, evidence=evidence,
            detected_at=now, action=action, outcome=outcome,
        )
        incident = self._record(incident)
        if state != IncidentState.OPEN:
            incident = self._record(incident.transition(state, outcome=outcome or None, now=now))
        self._open = incident if state == IncidentState.ACTING else None

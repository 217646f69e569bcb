"""Crash and restart incidents, from the launcher's structured report of a failed worker round.

The launcher (agent/launch/elastic.py) reports each failed round with every failed worker's global and
local rank, pid, exit code and error-file message, then whether it restarts the group. ``WorkerFailureRecorder``
turns each failed round into one incident: ``crash`` when a worker died of a signal or a non-zero exit
that neither the watchdog's abort nor torchrun caused, ``restart`` otherwise: exit code ``EXIT_ABORTED``, a
SIGKILL the agent sent to a worker that could not obey the abort (``killed_by_agent``), and SIGTERM (torchrun
stopping the survivors of a failed round) are consequences; the watchdog's own hang incident explains an
abort. The incident is ``acting`` while the group restarts and ``resolved`` when a step of a later round
completes; if the restart budget is spent, ``failed``.

torchrun reports the failures it noticed, which often include peers the dead rank took down (rank 5 is
SIGKILLed, the others' next collective fails and they exit 1). A crash incident names the rank(s) that
failed first and lists the others in ``evidence["collateral"]``: the rule is ``first_failure``
(agent/incidents/first_failure.py): last words that say a peer is gone make a rank collateral, a signal
beats an exit code, the earliest exit (the launcher's exit time, else when its telemetry stream ended)
breaks ties. When every failed rank here left because a peer was gone, the failure is on another node:
a ``restart`` naming no rank here. The ended telemetry streams (who said goodbye, and why) are kept as
evidence: only those of the failed round's own workers, the ones that ended after the round started
(``round_started``). A restart the watchdog's abort or a regroup caused records no incident here, and the
old round's workers' streams break (SIGKILL, no goodbye) after it: seen in the soak, where such a stream,
39 s older than the failure, named a rank of the survivors as "its stream broke first, without a goodbye".
"""

from __future__ import annotations

import signal
import socket
import time
from typing import Callable, Mapping, Sequence

from trainwarden.agent.incidents.record import Incident, IncidentKind, IncidentState, new_incident_id
from trainwarden.agent.incidents.first_failure import first_failure
from trainwarden.agent.shared.contract import EXIT_ABORTED

__all__ = ["WorkerFailureRecorder", "describe_exit", "describe_failures"]


def describe_exit(exitcode: int) -> str:
    """"SIGKILL", "aborted by the agent", "exit code 1"."""
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    if exitcode == EXIT_ABORTED:
        return "aborted by the agent"
    return f"exit code {exitcode}"


def describe_failures(failures: list[dict]) -> str:
    """"rank 2 (SIGKILL); torchrun stopped ranks 0,1,3": the ranks torchrun terminated itself come last."""
    stopped = sorted(f["global_rank"] for f in failures if int(f["exitcode"]) == -signal.SIGTERM)
    failed = [f"rank {f['global_rank']} ({describe_exit(int(f['exitcode']))})" for f in failures
              if int(f["exitcode"]) != -signal.SIGTERM]
    parts = ["; ".join(failed)] if failed else []
    if stopped:
        parts.append(f"torchrun stopped rank{'s' if len(stopped) > 1 else ''} {','.join(map(str, stopped))}")
    return "; ".join(parts) or "no worker reported"


class WorkerFailureRecorder:
    """One incident per failed worker round; see the module docstring."""

    def __init__(self, job: str, record: Callable[[Incident], Incident], *, node: str | None = None,
                 wall: Callable[[], float] = time.time,
                 ended_streams: Callable[[float], list[dict]] | None = None,
                 killed_by_agent: Callable[[int], bool] = lambda pid: False) -> None:
        self._job, self._record, self._wall = job, record, wall
        self._ended_streams = ended_streams
        self._killed_by_agent = killed_by_agent
        self._since = wall()  # streams that ended before this belong to an earlier round
        self._node = node or socket.gethostname()
        self._failures: list[dict] = []
        self._open: Incident | None = None

    def round_failed(self, failures: Sequence[Mapping]) -> None:
        """The launcher's report of the failed workers (global_rank, local_rank, pid, exitcode, message,
        exited_at)."""
        self._failures = [{"global_rank": int(f["global_rank"]), "local_rank": int(f["local_rank"]),
                           "pid": f.get("pid"), "exitcode": int(f["exitcode"]),
                           "cause": describe_exit(int(f["exitcode"])),
                           **({"error": str(f["message"])[:500]} if f.get("message") else {}),
                           **({"exited_at": float(f["exited_at"])} if f.get("exited_at") is not None else {})}
                          for f in failures]

    def round_started(self, at: float) -> None:
        """A worker round started at wall time ``at``: streams that ended before it are an earlier round's."""
        self._since = max(self._since, at)

    def restarting(self) -> None:
        """The launcher restarts the group after the failure: the incident is acting until a step completes."""
        self._start(IncidentState.ACTING, "torchrun restarts the worker group")

    def resumed(self, step: int) -> None:
        """A step of the new round completed."""
        if self._open is not None:
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
        now = self._wall()
        ended = self._ended()
        own = [f for f in failures if self._caused_here(f)]
        verdict = first_failure(own, ended) if own else None  # no exit of its own: no stream makes it a crash
        evidence: dict = {"failed_workers": failures, **({"telemetry_streams_ended": ended} if ended else {})}
        crashed = verdict is not None and bool(verdict.first)
        if verdict is None:  # every exit was the agent's abort or torchrun's stop: the restart's reason is elsewhere
            ranks = tuple(sorted({f["global_rank"] for f in failures}))
            evidence["ranks_are"] = "global ranks the launcher reported failed"
        else:  # the ranks torchrun stopped or the agent aborted after the first failure are collateral too
            ranks = verdict.first
            collateral = sorted(({f["global_rank"] for f in failures} | set(verdict.collateral)) - set(ranks))
            evidence.update(ranks_are="global rank(s) that failed first" if crashed else
                            "none: the failure is not on this node", collateral=collateral,
                            summary=f"{verdict.why}; {len(collateral)} collateral"
                            f"{' (ranks ' + ','.join(map(str, collateral)) + ')' if collateral else ''}")
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

    def _ended(self) -> list[dict]:
        """The telemetry streams that ended since the last incident, oldest first (evidence only: never raises)."""
        if self._ended_streams is None:
            return []
        try:
            return self._ended_streams(self._since)
        except Exception:
            return []

    def _caused_here(self, failure: dict) -> bool:
        """The worker failed of its own accord (not the agent's abort, nor torchrun stopping it)."""
        code = failure["exitcode"]
        if code in (0, EXIT_ABORTED, -signal.SIGTERM):
            return False
        return not (code == -signal.SIGKILL and failure.get("pid") is not None
                    and self._killed_by_agent(int(failure["pid"])))

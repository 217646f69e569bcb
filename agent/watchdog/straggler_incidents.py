"""Straggler events as incidents (agent/watchdog/loop.py feeds it the ``StragglerDetector``'s events): the rank's
flag, a ``straggler_start`` incident when flagged and a ``straggler_end`` that resolves it when back in line, under
``--straggler-policy exclude`` the node's request to leave the job at the next restart and its withdrawal, and the
limits: at most one open incident per rank and ``max_incidents_per_hour`` per job, and no start while the job is in a
communication regression or its latest window was suspect (a start not recorded makes its end not recorded either;
suppressions are counted, ``suppressed``, and logged). In the soak's hour (seed 46, #43) a link degraded 6 s into a
new worker round: the straggler detector learned its level from degraded slices and named n0's rank 0 (score 1.53,
peers' work up 1.26x) 0.5 s after the ``comm_regression`` that explained the slowdown."""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable

from trainwarden.agent.incidents import Incident, IncidentKind, IncidentState, new_incident_id
from trainwarden.agent.telemetry.job_telemetry import JobSnapshot
from trainwarden.agent.watchdog.interface import WatchdogActions
from trainwarden.agent.watchdog.straggler import StragglerConfig, StragglerEvent, StragglerPolicy

__all__ = ["StragglerIncidents"]

log = logging.getLogger("trainwarden.agent.watchdog.loop")  # the watchdog's log, as before the split


class StragglerIncidents:
    """The incidents of one agent's straggler events (module docstring)."""

    def __init__(self, actions: WatchdogActions, *, node: str, config: StragglerConfig, wall: Callable[[], float],
                 set_flag: Callable[[str, int, str, bool], None],
                 links_suspect: Callable[[str], bool] = lambda job: False) -> None:
        """``links_suspect(job)``: whether the communication-regression watch has the job regressed or suspect;
        a start then is not recorded (module docstring)."""
        self._actions, self._node, self._config, self._wall, self._set_flag = actions, node, config, wall, set_flag
        self._links_suspect = links_suspect
        self._stragglers: dict[tuple[str, int], Incident] = {}  # open straggler_start incidents
        self._starts: dict[str, deque[float]] = {}  # job -> wall times of recent starts (rate limit)
        self._suppressed: set[tuple[str, int]] = set()  # flagged without an incident
        self.suppressed: dict[str, int] = {}
        """job -> straggler incidents not recorded (exported by the watchdog's collector)."""

    def on_event(self, snap: JobSnapshot, event: StragglerEvent) -> None:
        """A rank flagged (``event.started``) or back in line: its flag, its incident, and under ``exclude`` the
        request to leave the job at the next restart (or its withdrawal once no rank of this node straggles)."""
        job, rank, s = snap.job, event.rank, event.score
        now = self._wall()
        evidence = {"score": round(s.score, 4), "compute_share": round(s.compute_share, 4),
                    "peer_compute_share": round(s.peer_compute_share, 4),
                    "peer_wait_share": round(s.peer_wait_share, 4), "peer_work_growth": round(s.peer_growth, 3),
                    "window_seconds": round(s.window_seconds, 3), "steps_persisted": event.evaluations,
                    "step": max((r.last_step for r in snap.ranks), default=-1), "policy": event.policy.value,
                    "hostname": next((r.hostname for r in snap.ranks if r.rank == rank), "")}
        evidence["persisted_seconds"] = round(event.seconds, 1)
        verb = "has been" if event.started else "is back in line:"
        evidence["summary"] = (f"rank {rank} {verb} busy {s.compute_share:.0%} of its time against its peers' "
                               f"{s.peer_compute_share:.0%} (score {s.score:.2f}) for {event.seconds:.0f} s"
                               + (f", so they wait for it {s.peer_wait_share:.0%} of the time" if event.started
                                  else ""))
        self._set_flag(job, rank, "straggler", event.started)
        if not self._admit(job, rank, event.started, now):
            return
        if event.started:
            action = "alert" if event.policy == StragglerPolicy.ALERT else \
                f"exclude node {evidence['hostname'] or self._node} at the next restart (requested)"
            start = self._stragglers[(job, rank)] = self._actions.record(Incident(
                id=new_incident_id(now), kind=IncidentKind.STRAGGLER_START, job=job, node=self._node,
                ranks=(rank,), evidence=evidence, detected_at=now, updated_at=now, action=action,
                outcome="straggling"))
            if event.policy == StragglerPolicy.EXCLUDE:
                self._actions.request_exclusion(job, self._node, {
                    "node": self._node, "job": job, "rank": rank, "incident": start.id, "since": now,
                    "reason": f"straggler: rank {rank} score {s.score:.2f} (policy exclude)"})
            return
        end = Incident(id=new_incident_id(now), kind=IncidentKind.STRAGGLER_END, job=job, node=self._node,
                       ranks=(rank,), evidence=evidence, detected_at=now, updated_at=now, action="clear flag")
        self._actions.record(end.transition(IncidentState.RESOLVED, outcome="rank back in line", now=now))
        start = self._stragglers.pop((job, rank), None)
        if event.policy == StragglerPolicy.EXCLUDE and not any(j == job for j, _ in self._stragglers):
            self._actions.withdraw_exclusion(job, self._node)  # no rank of this node straggles any more
        if start is not None:
            self._actions.record(start.transition(
                IncidentState.RESOLVED, outcome=f"cleared ({end.id}) after {now - start.detected_at:.0f} s", now=now))

    def _admit(self, job: str, rank: int, started: bool, now: float) -> bool:
        """At most one open straggler incident per rank, and at most `max_incidents_per_hour` per job; a
        start not recorded makes its end not recorded either. Suppressions are counted and logged."""
        key = (job, rank)
        if not started:
            if key in self._suppressed:
                self._suppressed.discard(key)
                return False
            return True
        recent = self._starts.setdefault(job, deque())
        while recent and now - recent[0] > 3600.0:
            recent.popleft()
        if key in self._stragglers:
            reason = "an incident for this rank is still open"
        elif self._links_suspect(job):
            reason = ("the job's collectives are slower on every rank (a communication regression): waits for them "
                      "land inside the ranks' own intervals")
        elif len(recent) >= self._config.max_incidents_per_hour:
            reason = f"{len(recent)} straggler incidents opened in the last hour (the limit)"
        else:
            recent.append(now)
            return True
        self._suppressed.add(key)
        self.suppressed[job] = self.suppressed.get(job, 0) + 1
        log.warning("job %s rank %d flagged as a straggler again; no incident recorded: %s", job, rank, reason,
                    extra={"job": job, "rank": rank})
        return False

    def close(self, job: str | None, outcome: str) -> None:
        """Resolve the open straggler incidents of `job` (None: every job): no end event will come."""
        for key in [k for k in self._stragglers if job is None or k[0] == job]:
            start = self._stragglers.pop(key)
            try:
                self._actions.record(start.transition(IncidentState.RESOLVED, outcome=outcome, now=self._wall()))
            except Exception:
                log.exception("closing straggler incident %s failed", start.id)

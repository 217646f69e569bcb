"""Incidents for what goes wrong with a job's checkpoints, from the stages the workers report.

A failed save (``failed``: disk full, an I/O error, a permission) and a checkpoint a restore passed over
(``set_aside``: quarantined as unfinished, corrupt or unloadable, or unreadable and left in place) each
become one incident, however many ranks report the same event: the first report of (job, stage, step) or
(job, path) counts. A ``TelemetryListener`` on the node's ``JobTelemetry``; the incident store writes to
disk and queues the etcd copy, so nothing here waits.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import OrderedDict
from typing import Callable

from trainwarden.agent.incidents import Incident, IncidentKind, IncidentState, new_incident_id

__all__ = ["CheckpointIncidents"]

_OUTCOMES = {
    "failed": ("none: training goes on", "the latest committed checkpoint is unchanged; the next save may succeed "
               "(check free space and permissions)"),
    "set_aside": ("kept aside for inspection, never deleted", "the job resumed from an older checkpoint, or stopped "
                  "if none could be loaded"),
}


class CheckpointIncidents:
    def __init__(self, record: Callable[[Incident], Incident], *, node: str | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        self._record, self._wall = record, wall
        self._node = node or socket.gethostname()
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self._lock = threading.Lock()

    def on_step(self, job: str, rank: int, pid: int, index: int, start_unix: float, duration_s: float) -> None:
        pass

    def on_checkpoint(self, job: str, rank: int, stage: str, step: int, path: str, nbytes: int,
                      detail: str = "") -> None:
        if stage not in _OUTCOMES:
            return
        key = (job, stage, step) if stage == "failed" else (job, stage, path or step)
        with self._lock:
            if key in self._seen:
                return
            self._seen[key] = None
            while len(self._seen) > 4096:
                self._seen.popitem(last=False)
        action, outcome = _OUTCOMES[stage]
        kind = IncidentKind.CHECKPOINT_FAILED if stage == "failed" else IncidentKind.CHECKPOINT_SET_ASIDE
        now = self._wall()
        what = f"the save of step {step} failed" if stage == "failed" else f"a restore set {path or f'step {step}'} aside"
        incident = self._record(Incident(
            id=new_incident_id(now), kind=kind, job=job, node=self._node, ranks=(rank,), detected_at=now,
            updated_at=now, action=action,
            evidence={"step": step, "path": path, "detail": detail, "summary": f"{what}: {detail or 'no detail'}"}))
        self._record(incident.transition(IncidentState.RESOLVED, outcome=outcome, now=now))

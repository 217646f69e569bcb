"""Incidents for what goes wrong with a job's checkpoints, from the stages the workers report.

- A failed save (``failed``: disk full, an I/O error, a permission) is one ``checkpoint_failed`` incident,
  resolved at once: training goes on and the latest committed checkpoint is unchanged.
- A checkpoint a restore passed over (``set_aside``: quarantined as unfinished, corrupt or unloadable) is one
  ``checkpoint_set_aside`` incident, ``acting`` until the restore ends. Its outcome then says which way it
  ended: resolved with the step the job resumed from (``restored`` with a step), or started fresh (a
  fresh start the job allowed on purpose), or failed because the job stopped (``resume_blocked``).
- A restore that refuses to start over or cannot read the checkpoints (``resume_blocked``) is one
  ``resume_blocked`` incident, failed: the job stopped and spent no restart; the detail says what was
  found and what to do.

However many ranks report the same event, the first report of (job, stage, step) or (job, path) counts. A
``TelemetryListener`` on the node's ``JobTelemetry``; the incident store writes to disk and queues the etcd
copy, so nothing here waits.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import OrderedDict
from typing import Callable

from trainwarden.agent.incidents import Incident, IncidentKind, IncidentState, new_incident_id

__all__ = ["CheckpointIncidents"]

_SAVE_FAILED_OUTCOME = ("the latest committed checkpoint is unchanged; the next save may succeed (check free space "
                        "and permissions)")


class CheckpointIncidents:
    def __init__(self, record: Callable[[Incident], Incident], *, node: str | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        self._record, self._wall = record, wall
        self._node = node or socket.gethostname()
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self._pending: dict[str, list[Incident]] = {}  # job -> set-aside incidents whose restore has not ended
        self._lock = threading.Lock()

    def on_step(self, job: str, rank: int, pid: int, index: int, start_unix: float, duration_s: float) -> None:
        pass

    def on_checkpoint(self, job: str, rank: int, stage: str, step: int, path: str, nbytes: int,
                      detail: str = "", seconds: float = 0.0) -> None:
        if stage == "restored":
            self._close(job, IncidentState.RESOLVED, f"the job resumed from step {step}" if step > 0 else
                        "the job started from step 1, on purpose (a fresh start was allowed)")
        elif stage in ("failed", "set_aside", "resume_blocked") and self._first(job, stage, step, path):
            self._open(job, rank, stage, step, path, detail)

    def _first(self, job: str, stage: str, step: int, path: str) -> bool:
        key = (job, stage, step) if stage == "failed" else (job, stage, path or step)
        with self._lock:
            if key in self._seen:
                return False
            self._seen[key] = None
            while len(self._seen) > 4096:
                self._seen.popitem(last=False)
        return True

    def _open(self, job: str, rank: int, stage: str, step: int, path: str, detail: str) -> None:
        now = self._wall()
        kind, action, what = {
            "failed": (IncidentKind.CHECKPOINT_FAILED, "none: training goes on", f"the save of step {step} failed"),
            "set_aside": (IncidentKind.CHECKPOINT_SET_ASIDE, "kept aside for inspection, never deleted",
                          f"a restore set {path or f'step {step}'} aside"),
            "resume_blocked": (IncidentKind.RESUME_BLOCKED, "the job stops; no restart is spent",
                               f"the job may not resume from {path or 'its checkpoints'}"),
        }[stage]
        incident = self._record(Incident(
            id=new_incident_id(now), kind=kind, job=job, node=self._node, ranks=(rank,), detected_at=now,
            updated_at=now, action=action,
            evidence={"step": step, "path": path, "detail": detail, "summary": f"{what}: {detail or 'no detail'}"}))
        if stage == "failed":
            self._record(incident.transition(IncidentState.RESOLVED, outcome=_SAVE_FAILED_OUTCOME, now=now))
        elif stage == "set_aside":
            acting = self._record(incident.transition(IncidentState.ACTING, now=now))
            with self._lock:
                self._pending.setdefault(job, []).append(acting)
        else:
            self._close(job, IncidentState.FAILED, f"the job stopped without loading a checkpoint ({incident.id})")
            self._record(incident.transition(IncidentState.FAILED, outcome=(
                "stopped: fix the storage or put a checkpoint back (trainwarden checkpoints), then resume"), now=now))

    def _close(self, job: str, state: IncidentState, outcome: str) -> None:
        with self._lock:
            pending = self._pending.pop(job, [])
        now = self._wall()
        for incident in pending:
            self._record(incident.transition(state, outcome=outcome, now=now))

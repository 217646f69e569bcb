"""Incidents for numeric events: a step whose loss or gradients were not finite (or whose loss spiked).

The workers' numeric guard (runtime/numeric.py) agrees on each event across the ranks through one collective, and
the first rank that saw it reports it (a ``Numeric`` record): one ``numeric`` incident naming that rank and the
step, closed at once by what the policy did:

- ``rolled_back``: resolved; every rank skipped the step's update, training goes on with the next batch;
- ``stopped``: failed; the job stopped with the evidence (the ``stop`` policy, or non-finite values again soon
  after a rollback), and the launcher spends no restart on it;
- ``alerted``: resolved with "none taken": the update applied and the weights may be NaN from then on (for kind
  ``sdc``, the silent-corruption check of runtime/sdc_check.py, it says that the rank's node computed wrong).

A report repeated for the same (job, kind, step, action), after a restart that replays the step, counts once. A
``TelemetryListener`` on the node's ``JobTelemetry``, like checkpoint_incidents.py: nothing here waits.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import OrderedDict
from typing import Callable

from trainwarden.agent.incidents import Incident, IncidentKind, IncidentState, new_incident_id

__all__ = ["NumericIncidents"]

_OUTCOMES = {
    "rolled_back": (IncidentState.RESOLVED, "every rank skipped the step's update: the state is the one before it, "
                    "its batch was not trained on; training goes on"),
    "stopped": (IncidentState.FAILED, "the job stopped and spent no restart: look at the data and the learning "
                "rate around this step, or run again with --numeric-policy alert to see where it goes"),
    "alerted": (IncidentState.RESOLVED, "none taken (numeric policy alert): the update applied, the weights may "
                "hold NaN from this step on"),
}
_WHAT = {"nan": "not finite", "loss_spike": "a loss spike", "sdc": "computed wrong (silent data corruption)"}


class NumericIncidents:
    def __init__(self, record: Callable[[Incident], Incident], *, node: str | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        self._record, self._wall = record, wall
        self._node = node or socket.gethostname()
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self._lock = threading.Lock()

    def on_step(self, job: str, rank: int, pid: int, index: int, start_unix: float, duration_s: float) -> None:
        pass

    def on_checkpoint(self, job: str, rank: int, stage: str, step: int, path: str, nbytes: int,
                      detail: str = "", seconds: float = 0.0) -> None:
        pass

    def on_numeric(self, job: str, rank: int, kind: str, step: int, first_rank: int, action: str,
                   detail: str) -> None:
        key = (job, kind, step, action)
        with self._lock:
            if key in self._seen:
                return
            self._seen[key] = None
            while len(self._seen) > 4096:
                self._seen.popitem(last=False)
        state, outcome = _OUTCOMES.get(action, (IncidentState.RESOLVED, f"the workers said: {action or 'nothing'}"))
        if kind == "sdc":  # a check, not the step's gradient: nothing to roll back, the node is what to act on
            outcome = ("none taken: the update applied; the rank's node computed a gradient wrong: drain it if it is "
                       "named again (docs/OPERATIONS.md, TrainwardenNumericEvents)")
        now = self._wall()
        where = f"first on rank {first_rank}" if first_rank >= 0 else "on every rank"
        incident = self._record(Incident(
            id=new_incident_id(now), kind=IncidentKind.NUMERIC, job=job, node=self._node,
            ranks=(first_rank,) if first_rank >= 0 else (),
            detected_at=now, updated_at=now, action={"rolled_back": "rolled back", "stopped": "job stopped",
                                                     "alerted": "alert only"}.get(action, action),
            evidence={"kind": kind, "step": step, "first_rank": first_rank, "action": action, "detail": detail,
                      "summary": f"step {step} was {_WHAT.get(kind, kind)}, {where}: {detail}"}))
        self._record(incident.transition(state, outcome=outcome, now=now))

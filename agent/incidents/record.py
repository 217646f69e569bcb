"""Incident records: what the watchdog saw, what it did, and how it ended.

One `Incident` per event worth a human's attention: a hang, a straggler starting or ending, a crash, a
restart. Each has a sortable id (UTC time to the millisecond plus 6 random hex digits, so ids from
different agents never collide and `ls` shows them in order), the evidence that led to it, the action
taken and the outcome. Incidents have a lifecycle::

    open -> acting -> resolved
      \\        \\---> failed
       \\-> resolved | failed

checked against `_TRANSITIONS` (an illegal one raises `IllegalIncidentTransition`, a bug) and logged.
`Incident` is frozen: `transition()` returns the next version, and `IncidentStore.record()` (store.py)
stores each version under the same id.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["IllegalIncidentTransition", "Incident", "IncidentKind", "IncidentState", "new_incident_id"]

log = logging.getLogger(__name__)


class IncidentKind(str, enum.Enum):
    HANG = "hang"
    STRAGGLER_START = "straggler_start"
    STRAGGLER_END = "straggler_end"
    COMM_REGRESSION = "comm_regression"
    """The job's steps are slower because its collectives are, on every rank, while no rank computes more (a
    degraded link or node): open while it lasts, resolved when the step time is back near its baseline."""
    CRASH = "crash"
    RESTART = "restart"
    CHECKPOINT_FAILED = "checkpoint_failed"
    """A save failed (disk full, I/O error); the latest committed checkpoint is unchanged."""
    CHECKPOINT_SET_ASIDE = "checkpoint_set_aside"
    """A restore passed a checkpoint over: quarantined (unfinished, corrupt, unloadable) or unreadable."""
    RESUME_BLOCKED = "resume_blocked"
    """The job stopped rather than start over: it has committed checkpoints but none could be read or loaded
    (a storage problem, or every one corrupt). No restart was spent; the evidence says what was found."""
    CORDONED = "cordoned"
    """The node takes no new work (an operator's cordon or drain, or the daemon's own on a GPU fault); with a
    drain its jobs leave it after a checkpoint. Recorded for each job the node was running."""
    FENCED = "fenced"
    """The node lost etcd for longer than its membership lease and stopped its workers; it rejoins the job as
    a new member when etcd answers again."""
    NODE_LOST = "node_lost"
    """A node of the job stopped renewing its membership lease (killed, powered off, cut off): which node,
    its ranks in the last round, when its lease ended. Recorded once per loss, by one surviving node."""
    SPARE_SWAP = "spare_swap"
    """A hot spare took the ranks of a node that a policy excluded (straggler or link policy ``exclude``): which
    node, why, the step it left after, and the spare. A spare that replaced a lost node names itself in the
    ``node_lost`` incident instead."""
    AUTO_RESUME = "auto_resume"
    """The daemon's Alertmanager webhook decided on an alert about the job: resumed it (a new generation), or
    not (a duplicate, throttled, rejected), and why."""
    NUMERIC = "numeric"
    """A step's loss or gradients were not finite (or its loss spiked), as the workers' numeric guard agreed: the
    first rank and the step, and what the policy did (the update skipped on every rank, the job stopped, or an
    alert only)."""
    JOB_REFUSED = "job_refused"
    """A node daemon cannot run a submitted job (its spec does not parse, or its script or checkpoint directory is
    missing on the node): recorded once per generation and spec revision; a pending generation becomes
    ``refused``."""


class IncidentState(str, enum.Enum):
    OPEN = "open"
    """Detected; nothing done yet."""
    ACTING = "acting"
    """An action is under way (e.g. workers aborted, waiting for the restart to progress)."""
    RESOLVED = "resolved"
    FAILED = "failed"
    """The action failed or the problem outlived it."""


_TRANSITIONS: dict[IncidentState, frozenset[IncidentState]] = {
    IncidentState.OPEN: frozenset({IncidentState.ACTING, IncidentState.RESOLVED, IncidentState.FAILED}),
    IncidentState.ACTING: frozenset({IncidentState.RESOLVED, IncidentState.FAILED}),
    IncidentState.RESOLVED: frozenset(),
    IncidentState.FAILED: frozenset(),
}


class IllegalIncidentTransition(RuntimeError):
    """A transition the lifecycle does not allow: a bug in the caller, not retryable."""


def new_incident_id(now: float | None = None) -> str:
    """Sortable unique id: ``20261122T141530123Z-3fa9c1``."""
    t = datetime.datetime.fromtimestamp(time.time() if now is None else now, tz=datetime.timezone.utc)
    return f"{t.strftime('%Y%m%dT%H%M%S')}{t.microsecond // 1000:03d}Z-{secrets.token_hex(3)}"


@dataclass(frozen=True, kw_only=True)
class Incident:
    """One incident (one version of it: see `transition`)."""

    id: str
    kind: IncidentKind
    job: str
    node: str
    ranks: tuple[int, ...] = ()
    """The ranks concerned: the culprits of a hang, the straggler."""
    evidence: Mapping[str, Any] = field(default_factory=dict)
    """JSON-serialisable facts that led to the incident."""
    detected_at: float = 0.0
    """Wall-clock time (Unix seconds)."""
    state: IncidentState = IncidentState.OPEN
    action: str = ""
    """What was done about it."""
    outcome: str = ""
    """How it ended (or why it is still open)."""
    updated_at: float = 0.0
    """Wall-clock time of the last transition."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", IncidentKind(self.kind))
        object.__setattr__(self, "state", IncidentState(self.state))
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))

    def transition(self, to: IncidentState, *, action: str | None = None, outcome: str | None = None,
                   now: float | None = None) -> "Incident":
        """The next version of this incident in state `to` (checked against the lifecycle table)."""
        to = IncidentState(to)
        if to != self.state and to not in _TRANSITIONS[self.state]:
            raise IllegalIncidentTransition(f"incident {self.id}: {self.state.value} -> {to.value} is not allowed")
        log.info("incident %s (%s, job %s): %s -> %s%s", self.id, self.kind.value, self.job, self.state.value,
                 to.value, f": {outcome}" if outcome else "")
        return dataclasses.replace(
            self, state=to, action=self.action if action is None else action,
            outcome=self.outcome if outcome is None else outcome, updated_at=time.time() if now is None else now)

    def to_json(self) -> dict:
        return {"id": self.id, "kind": self.kind.value, "job": self.job, "node": self.node,
                "ranks": list(self.ranks), "evidence": dict(self.evidence), "detected_at": self.detected_at,
                "state": self.state.value, "action": self.action, "outcome": self.outcome,
                "updated_at": self.updated_at}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Incident":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"incident record has unknown keys {unknown}; is it from a newer trainwarden?")
        return cls(**{**data, "ranks": tuple(data.get("ranks", ())), "evidence": dict(data.get("evidence") or {})})

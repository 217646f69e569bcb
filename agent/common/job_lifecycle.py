"""A job's lifecycle: an enum of phases and the transitions allowed between them.

Every transition is checked against the table and logged; an illegal one raises, because it means
the supervisor's picture of the job is wrong, and acting on a wrong picture (restarting a job that
finished, say) is worse than stopping.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

__all__ = ["IllegalTransition", "JobPhase", "JobRecord"]


class JobPhase(str, enum.Enum):
    PENDING = "pending"
    """Accepted, nothing started yet."""
    STARTING = "starting"
    """Rendezvous and worker start-up; no step completed in this round yet."""
    RUNNING = "running"
    """Steps are completing."""
    RESTARTING = "restarting"
    """A worker failed; torchrun is restarting the worker group."""
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    """Stopped by an operator (Ctrl-C or SIGTERM to `trainwarden run`)."""
    REFUSED = "refused"
    """Never started: a node daemon cannot run this generation (its spec does not parse, or the script or the
    checkpoint directory is missing on the node); the reason says which node and why (agent/node/job_refusal.py)."""

    @property
    def terminal(self) -> bool:
        return self in (JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.STOPPED, JobPhase.REFUSED)


_TRANSITIONS: dict[JobPhase, frozenset[JobPhase]] = {
    JobPhase.PENDING: frozenset({JobPhase.STARTING, JobPhase.FAILED, JobPhase.STOPPED, JobPhase.REFUSED}),
    JobPhase.STARTING: frozenset({JobPhase.RUNNING, JobPhase.RESTARTING, JobPhase.SUCCEEDED,
                                  JobPhase.FAILED, JobPhase.STOPPED}),
    JobPhase.RUNNING: frozenset({JobPhase.RESTARTING, JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.STOPPED}),
    JobPhase.RESTARTING: frozenset({JobPhase.STARTING, JobPhase.RUNNING, JobPhase.SUCCEEDED,
                                    JobPhase.FAILED, JobPhase.STOPPED}),
    JobPhase.SUCCEEDED: frozenset(),
    JobPhase.FAILED: frozenset(),
    JobPhase.STOPPED: frozenset(),
    JobPhase.REFUSED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A lifecycle transition that the table does not allow: a bug, not a retryable condition."""


@dataclass
class JobRecord:
    """What the supervisor knows of one job; serialised to etcd as ``jobs/<job>/state``."""

    job: str
    phase: JobPhase = JobPhase.PENDING
    generation: int = 0
    restarts: int = 0
    last_change: float = field(default_factory=time.time)
    reason: str = ""
    owner: dict = field(default_factory=dict)
    """Who supervises the job: host, pid and start time of the `trainwarden run` process."""

    def transition(self, to: JobPhase, reason: str = "", *, failure: bool = True) -> None:
        """Move to `to` (IllegalTransition if the table forbids it). A move to RESTARTING counts a restart
        unless ``failure`` is False (the group restarts because nodes joined, not because it failed)."""
        if to == self.phase:
            return
        if to not in _TRANSITIONS[self.phase]:
            raise IllegalTransition(f"job {self.job}: {self.phase.value} -> {to.value} is not allowed")
        logger.info("job %s: %s -> %s%s", self.job, self.phase.value, to.value, f" ({reason})" if reason else "")
        if to == JobPhase.RESTARTING and failure:
            self.restarts += 1
        self.phase, self.reason, self.last_change = to, reason, time.time()

    def to_json(self) -> dict:
        return {"job": self.job, "phase": self.phase.value, "generation": self.generation,
                "restarts": self.restarts, "last_change": self.last_change, "reason": self.reason,
                "owner": self.owner}


def supervisor_gone(owner: dict, *, host: str) -> bool:
    """True when ``owner`` (a JobRecord's) ran on ``host`` and that process no longer exists there.

    A supervisor killed hard (SIGKILL, OOM, reboot) leaves its job's phase non-terminal in etcd; this is
    how a new run on the same host tells such a leftover from a job that is really running.
    """
    import psutil

    from trainwarden.agent.common.process_identity import running_since

    if not owner or owner.get("host") != host:
        return False
    try:
        started = running_since(int(owner["pid"]))  # None for a zombie too: killed, not reaped yet
        return started is None or started != owner.get("started")
    except (KeyError, ValueError, TypeError):
        return True
    except psutil.Error:
        return False

"""This node's current worker round, as ``trainwarden run`` (agent/launch/run.py) knows it: the one fact the
supervisor's parts share about the workers. The supervisor replaces it when torch's agent starts a round (the
launcher's ``started`` event) and records each step a worker completes in it; fencing (fencing.py) asks whether a
process is one of its workers and which round commits are checked against, the leave and grow protocols
(regroup.py) which step the job has reached and which ranks leave.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from trainwarden.agent.etcd.cluster import round_id

__all__ = ["WorkerRound"]


@dataclass
class WorkerRound:
    """One round of this node's workers; a new round is a new object (only ``step`` and ``step_end`` move)."""

    generation: int = 0
    """The job's generation (a new one per take-over or resume: agent/launch/job_entry.py ``_take_over``)."""
    number: int | None = None
    """The rendezvous round the workers started in; None before the first round, or where the rendezvous handler
    names none."""
    pids: tuple[int, ...] = ()
    """The workers torch's agent started (for warm workers: the clients that stand for them)."""
    ranks: tuple[int, ...] = ()
    """This node's global ranks in the round, sorted."""
    step: int = field(default=0, compare=False)
    """The latest step a worker of the round completed (0: none yet)."""
    step_end: float = field(default=0.0, compare=False)
    """When it ended: wall clock, the step's own timestamp (0: none yet)."""

    @classmethod
    def started(cls, generation: int, event: dict) -> WorkerRound:
        """The round the launcher's ``started`` event announces (agent/launch/elastic.py)."""
        workers = event.get("workers") or []
        return cls(generation=generation, number=event.get("round"),
                   pids=tuple(w["pid"] for w in workers if w.get("pid")),
                   ranks=tuple(sorted(w["global_rank"] for w in workers)))

    @property
    def id(self) -> str | None:
        """The round as ``jobs/<job>/round`` holds it (agent/etcd/cluster.py ``round_id``); None without a number."""
        return None if self.number is None else round_id(self.generation, self.number)

    def stepped(self, index: int, end: float) -> None:
        """A worker completed step ``index`` at ``end`` (wall clock); steps arrive per rank, out of order."""
        if index >= self.step:
            self.step, self.step_end = index, end

    def has_worker(self, pid: int, stand_in: Callable[[int], int | None] | None = None) -> bool:
        """``pid`` is a worker of this round: one torch's agent started, or (``stand_in``: a warm worker's pid to
        the client it stands behind, runtime/zygote.py) the warm worker one of those stands for."""
        return pid in self.pids or (stand_in is not None and stand_in(pid) in self.pids)

"""Fencing and the commit guard: the part of ``trainwarden run`` (agent/launch/run.py) that keeps a node cut off
from etcd and its peers from training on, or from publishing a checkpoint, in a round the others have left.

* **Cut off** (``Fencing.cut_off``): this node's membership lapsed (etcd has not confirmed it for longer than its
  lease, so the others have seen it leave) and its workers stopped stepping. The supervisor then stops the
  workers and records the ``fenced`` incident this component writes (``incident``); the run waits for etcd and
  rejoins as a new member (run.py ``wait_for_etcd``).
* **The round in etcd** (``advance_round``): every node records the round its workers started in
  (``round_id(generation, rendezvous round)``), the rendezvous's round from the native handler or torch's state.
* **The commit guard** (``commit_refusal``): a rank may publish a checkpoint as the job's latest only from a
  worker of this node's current round, with the membership confirmed, and with that round still the job's
  current one in etcd (checked and published in one transaction).

``Fencing`` is a part the run owns, not a mixin: it reads only what it is given, the current worker round
(worker_round.py), this node's membership, the pace of its steps, and the job's rounds in etcd through a
``RoundLedger`` (``EtcdRounds``; tests give fakes). What acts (stopping the workers, the phase) stays with the run.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Protocol

from trainwarden.agent.etcd.client import ETCD_CLIENT_ERRORS, describe_etcd_error
from trainwarden.agent.etcd.cluster import advance_round, commit_in_round
from trainwarden.agent.etcd.membership import should_fence
from trainwarden.agent.incidents.record import Incident, IncidentKind, IncidentState, new_incident_id
from trainwarden.agent.launch.worker_round import WorkerRound

__all__ = ["FENCED", "EtcdRounds", "Fencing", "Membership", "RoundLedger"]

logger = logging.getLogger("trainwarden.agent.launch.run")  # the run's log

FENCED = object()
"""What ``supervise`` returns when this node was fenced: the run rejoins as a new member."""


class Membership(Protocol):
    """What fencing reads of this node's membership record (agent/etcd/membership.py ``NodeMembership``)."""

    confirmed_at: float | None
    ttl: float
    period: float

    def unconfirmed_for(self) -> float: ...


class RoundLedger(Protocol):
    """The job's current round and latest checkpoint, as every node sees them (``EtcdRounds``)."""

    def advance(self, round_id: str) -> str | None:
        """Make ``round_id`` the job's current round unless a newer one is recorded (then: why not)."""

    def commit(self, round_id: str, pointer: Mapping[str, Any]) -> str | None:
        """Publish ``pointer`` as the job's latest checkpoint if ``round_id`` is its current round, in one
        transaction; else why not."""

    def publish(self, pointer: Mapping[str, Any]) -> None:
        """Publish ``pointer`` with no round to check it against."""


class EtcdRounds:
    """``RoundLedger`` in etcd: ``jobs/<job>/round`` and ``jobs/<job>/checkpoint`` (agent/etcd/cluster.py)."""

    def __init__(self, client, records, job: str) -> None:
        self._client, self._records, self._job = client, records, job

    def advance(self, round_id: str) -> str | None:
        return advance_round(self._client, self._job, round_id)

    def commit(self, round_id: str, pointer: Mapping[str, Any]) -> str | None:
        return commit_in_round(self._client, self._job, round_id, pointer)

    def publish(self, pointer: Mapping[str, Any]) -> None:
        self._records.put_checkpoint(self._job, dict(pointer))


class Fencing:
    """The fencing decisions of one ``trainwarden run`` (module docstring).

    ``worker_round``: the run's current worker round (it replaces it as rounds start); ``pace``: the median of
    the workers' step durations (None: no steps yet). The membership, the ledger and the warm workers' stand-in
    come once the node entered the job (``joined``); before that nothing is fenced and every commit refused.
    """

    def __init__(self, *, job: str, node: str, multi_node: bool, worker_round: Callable[[], WorkerRound],
                 pace: Callable[[], float | None], clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.job, self.node, self.multi_node = job, node, multi_node
        self._round, self._pace, self._clock, self._wall_clock = worker_round, pace, clock, wall_clock
        self.membership: Membership | None = None
        self._ledger: RoundLedger | None = None
        self._stand_in: Callable[[int], int | None] | None = None
        self._last_step_at: float | None = None  # clock(): when a worker last completed a step

    def joined(self, membership: Membership, ledger: RoundLedger,
               stand_in: Callable[[int], int | None] | None = None) -> None:
        """This node entered the job: its membership record, the job's rounds, and (warm workers) the client pid
        a warm worker stands behind (agent/shared/contract.py ``warm_parent``)."""
        self.membership, self._ledger, self._stand_in = membership, ledger, stand_in

    def worker_stepped(self) -> None:
        """A worker of this node completed a step (its telemetry, or its output for scripts that send none)."""
        self._last_step_at = self._clock()

    def cut_off(self) -> bool:
        """This node's membership lapsed (etcd has not confirmed it for longer than its lease, so the other
        nodes have seen it leave) and its workers stopped stepping: the others train without it
        (agent/etcd/membership.py ``should_fence``). Never for a one-node job: nobody can take its place."""
        m = self.membership
        if m is None or not self.multi_node or m.confirmed_at is None:
            return False
        last = self._last_step_at
        return should_fence(unconfirmed_s=m.unconfirmed_for(), ttl_s=m.ttl, median_step_s=self._pace(),
                            since_last_step_s=None if last is None else self._clock() - last)

    def etcd_trouble(self) -> bool:
        """etcd has not confirmed this node's membership for two refresh periods (a multi-node job)."""
        m = self.membership
        return m is not None and self.multi_node and m.unconfirmed_for() > 2 * m.period

    def incident(self, why: str) -> Incident:
        """The ``fenced`` incident the run records once it stopped this node's workers."""
        m = self.membership
        return Incident(
            id=new_incident_id(), kind=IncidentKind.FENCED, job=self.job, node=self.node,
            evidence={"unconfirmed_s": round(m.unconfirmed_for() if m is not None else 0.0, 1), "why": why},
            detected_at=self._wall_clock(), state=IncidentState.RESOLVED,
            action="stopped this node's workers; rejoining as a new member when etcd answers")

    def advance_round(self, worker_round: WorkerRound) -> None:
        """Record ``worker_round`` as the job's current round in etcd (a thread of the run: it may wait on etcd)."""
        if self._ledger is None or worker_round.id is None:
            return
        try:
            refusal = self._ledger.advance(worker_round.id)
        except Exception as exc:  # a commit advances it too
            logger.warning("cannot record round %s of job %s in etcd: %s", worker_round.number, self.job,
                           describe_etcd_error(exc))
            return
        if refusal:
            logger.warning("job %s: %s", self.job, refusal)

    def commit_refusal(self, job: str, rank: int, pid: int, step: int, path: str, nbytes: int) -> str | None:
        """The telemetry server's commit guard: None when rank ``rank`` may publish checkpoint ``step`` as the
        job's latest, else why not. Only a worker of this node's current round, with this node's membership
        confirmed by etcd within its lease, and the round still the job's current one in etcd (checked and
        published in one transaction)."""
        if job != self.job:
            return None
        worker_round = self._round()
        if not worker_round.has_worker(pid, self._stand_in):
            return f"rank {rank} (pid {pid}) is not a worker of node {self.node}'s current round"
        m, ledger = self.membership, self._ledger
        if m is None or ledger is None or m.confirmed_at is None or m.unconfirmed_for() > 2 * m.period:
            # etcd away: do not wait on it
            unconfirmed = f"{m.unconfirmed_for():.0f} s" if m is not None and m.confirmed_at is not None else "ever"
            return (f"etcd has not confirmed node {self.node}'s membership for {unconfirmed}: the job's round "
                    "cannot be checked, and the other nodes may train on without this one")
        pointer = {"step": int(step), "path": path, "time": self._wall_clock(), "bytes": int(nbytes)}
        try:
            if worker_round.id is None:  # a rendezvous handler that names no round: membership is all we have
                ledger.publish(pointer)
                return None
            return ledger.commit(worker_round.id, pointer)
        except ETCD_CLIENT_ERRORS as exc:  # etcd lost quorum under us: refused, and said in one line
            return f"etcd could not check the job's round: {describe_etcd_error(exc)}"

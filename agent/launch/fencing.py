"""Fencing and the commit guard: the part of ``trainwarden run`` (agent/launch/run.py) that keeps a node cut off
from etcd and its peers from training on, or from publishing a checkpoint, in a round the others have left.

* **Cut off** (``_cut_off``): this node's membership lapsed (etcd has not confirmed it for longer than its lease, so
  the others have seen it leave) and its workers stopped stepping. ``_fence`` then stops the workers and records a
  ``fenced`` incident; the run waits for etcd and rejoins as a new member (run.py ``wait_for_etcd``).
* **The round in etcd** (``_advance_round``): every node records the round its workers started in
  (``round_id(generation, rendezvous round)``), the rendezvous's round from the native handler or torch's state.
* **The commit guard** (``_commit_refusal``): a rank may publish a checkpoint as the job's latest only from a
  worker of this node's current round, with the membership confirmed, and with that round still the job's
  current one in etcd (checked and published in one transaction).

``Fencing`` is a mixin of ``_JobRun``, as ``Regrouping``, ``LinkChecks`` and ``Accounting`` are: it uses the run's
state (options, node, etcd client, membership, progress, torchrun, agent, round) and is not meant to stand alone.
"""

from __future__ import annotations

import logging
import time

from trainwarden.agent.common.job_lifecycle import JobPhase
from trainwarden.agent.etcd.client import ETCD_CLIENT_ERRORS, describe_etcd_error
from trainwarden.agent.etcd.cluster import advance_round, commit_in_round, round_id
from trainwarden.agent.etcd.membership import should_fence
from trainwarden.agent.incidents.record import Incident, IncidentKind, IncidentState, new_incident_id
from trainwarden.agent.shared.contract import warm_parent, warm_paths

__all__ = ["FENCED", "Fencing"]

logger = logging.getLogger("trainwarden.agent.launch.run")  # the run's log

FENCED = object()
"""What ``supervise`` returns when this node was fenced: the run rejoins as a new member."""


class Fencing:
    """The fencing side of one ``trainwarden run`` (module docstring)."""

    def _cut_off(self) -> bool:
        """This node's membership lapsed (etcd has not confirmed it for longer than its lease, so the other
        nodes have seen it leave) and its workers stopped stepping: the others train without it
        (agent/etcd/membership.py ``should_fence``). Never for a one-node job: nobody can take its place."""
        m = self.membership
        if m is None or not self._multi_node or m.confirmed_at is None:
            return False
        return should_fence(unconfirmed_s=m.unconfirmed_for(), ttl_s=m.ttl,
                            median_step_s=self.progress.median_step_seconds(),
                            since_last_step_s=None if self._last_step_at is None
                            else time.monotonic() - self._last_step_at)

    def _etcd_trouble(self) -> bool:
        m = self.membership
        return m is not None and self._multi_node and m.unconfirmed_for() > 2 * m.period

    def _fence(self, why: str) -> object:
        """Stop this node's workers: they belong to a round the others have left (or are leaving). The node
        comes back only as a new member, through a new rendezvous (``wait_for_etcd``, then ``launch``)."""
        print(f"trainwarden: node {self.node} {why}: fencing (stopping its workers); it rejoins job "
              f"{self.opts.job} as a new member when etcd answers again", file=self.out, flush=True)
        self.pump.quiet = True
        self.torchrun.stop(grace=10.0)
        self.pump.join(5)
        self.events.join(5)
        self.pump.quiet = False
        if self.agent is not None:
            self.agent.incidents.record(Incident(
                id=new_incident_id(), kind=IncidentKind.FENCED, job=self.opts.job, node=self.node,
                evidence={"unconfirmed_s": round(self.membership.unconfirmed_for(), 1), "why": why},
                detected_at=time.time(), state=IncidentState.RESOLVED,
                action="stopped this node's workers; rejoining as a new member when etcd answers"))
        self.transition(JobPhase.RESTARTING, f"fenced: {why}")
        self.fenced += 1
        return FENCED

    def _advance_round(self, rendezvous_round: int) -> None:
        try:
            refusal = advance_round(self.client, self.opts.job, round_id(self.record.generation, rendezvous_round))
        except Exception as exc:  # a commit advances it too
            logger.warning("cannot record round %s of job %s in etcd: %s", rendezvous_round, self.opts.job,
                           describe_etcd_error(exc))
            return
        if refusal:
            logger.warning("job %s: %s", self.opts.job, refusal)

    def _is_round_worker(self, pid: int) -> bool:
        """``pid`` is a worker of this node's current round: one torch's agent started, or the warm worker
        one of those stands for (runtime/zygote.py)."""
        if pid in self._worker_pids:
            return True
        warm = getattr(self, "_warm", None)
        return warm is not None and warm_parent(pid, warm_paths(warm)[1]) in self._worker_pids

    def _commit_refusal(self, job: str, rank: int, pid: int, step: int, path: str, nbytes: int) -> str | None:
        """The telemetry server's commit guard: None when rank ``rank`` may publish checkpoint ``step`` as the
        job's latest, else why not. Only a worker of this node's current round, with this node's membership
        confirmed by etcd within its lease, and the round still the job's current one in etcd (checked and
        published in one transaction)."""
        if job != self.opts.job:
            return None
        if not self._is_round_worker(pid):
            return f"rank {rank} (pid {pid}) is not a worker of node {self.node}'s current round"
        m = self.membership
        if m is None or m.confirmed_at is None or m.unconfirmed_for() > 2 * m.period:  # etcd away: do not wait on it
            unconfirmed = f"{m.unconfirmed_for():.0f} s" if m is not None and m.confirmed_at is not None else "ever"
            return (f"etcd has not confirmed node {self.node}'s membership for {unconfirmed}: the job's round "
                    "cannot be checked, and the other nodes may train on without this one")
        pointer = {"step": int(step), "path": path, "time": time.time(), "bytes": int(nbytes)}
        try:
            if self._round is None:  # a rendezvous handler that names no round: membership is all we have
                self.records.put_checkpoint(job, pointer)
                return None
            return commit_in_round(self.client, job, round_id(self.record.generation, self._round), pointer)
        except ETCD_CLIENT_ERRORS as exc:  # etcd lost quorum under us: refused, and said in one line
            return f"etcd could not check the job's round: {describe_etcd_error(exc)}"

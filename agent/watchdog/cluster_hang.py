"""A hang on a job of several nodes: what the watchdog (agent/watchdog/loop.py) asks the job's other nodes, through
a ``HangCoordinator`` (agent/etcd/cluster.py).

- Activity: each check tells the other nodes whether this node's ranks work while the job is stalled, and holds a
  hang back while another node's do (the ranks here may only be waiting for them: rank 0 evaluating alone on its
  node). When etcd cannot be asked, the node judges alone for ``CLUSTER_RETRY_S``, as on one node.
- Ownership: a node that sees a hang shares its verdict and learns whether it records the hang (it owns it) or
  another node does; the owner gets every node's verdict that came in time, and the nodes that gave none are named
  (``silent_nodes``).
- Late verdicts: the owner reads them again for a while and amends its incident (agent/watchdog/late_verdicts.py).

Not thread-safe: the watchdog's thread calls it.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable

from trainwarden.agent.etcd.cluster import merge_verdicts
from trainwarden.agent.incidents import Incident
from trainwarden.agent.telemetry.job_telemetry import JobSnapshot
from trainwarden.agent.watchdog.hang import HangCheck, HangDetector
from trainwarden.agent.watchdog.late_verdicts import LateVerdicts

__all__ = ["CLUSTER_RETRY_S", "ClusterHangs", "hang_key"]

log = logging.getLogger("trainwarden.agent.watchdog.loop")  # the watchdog's log, as before the split

CLUSTER_RETRY_S = 10.0
"""After etcd failed to take or give a job's activity, this node judges the job's hangs alone for this long before
asking again: an unreachable etcd costs each check its client's timeout, and the watchdog checks every job."""


def hang_key(snap: JobSnapshot) -> str:
    """The hang's name across the nodes: the last step completed before the stall (the same on every node, an agent
    new to the job included: a restored rank's last step is the step it restored, agent/telemetry/job_telemetry.py)."""
    return str(max((r.last_step for r in snap.ranks), default=-1))


class ClusterHangs:
    """One job-wide view of hangs for this node's watchdog (module docstring)."""

    def __init__(self, cluster, hang: HangDetector, record: Callable[[Incident], Incident], *,
                 clock: Callable[[], float], wall: Callable[[], float]) -> None:
        self._cluster, self._hang, self._clock = cluster, hang, clock
        self._failing: dict[str, float] = {}  # job -> when to ask etcd again (its failure said once)
        self._deferred: dict[str, list[str]] = {}  # job -> the other nodes that last held its hang back (said once)
        self.late = LateVerdicts(cluster.verdicts, record, clock=clock, wall=wall) \
            if hasattr(cluster, "verdicts") else None

    def with_other_nodes(self, job: str, check: HangCheck) -> HangCheck:
        """``check`` as the other nodes' activity leaves it (module docstring)."""
        if self._clock() < self._failing.get(job, float("-inf")):
            return check
        try:
            self._cluster.set_busy(job, check.working)
            elsewhere = self._cluster.busy_elsewhere(job) if check.hung else []
        except Exception as exc:
            if job not in self._failing:
                log.warning("job %s: cannot share the ranks' activity with the other nodes through etcd (%s); "
                            "judging hangs from this node's ranks alone, asking again every %.0f s", job, exc,
                            CLUSTER_RETRY_S, extra={"job": job})
            self._failing[job] = self._clock() + CLUSTER_RETRY_S
            return check
        if self._failing.pop(job, None) is not None:
            log.info("job %s: sharing the ranks' activity with the other nodes again", job, extra={"job": job})
        if check.progressed:
            self._deferred.pop(job, None)
        if not elsewhere:
            return check
        self._hang.defer(job)
        if self._deferred.get(job) != elsewhere:
            self._deferred[job] = elsewhere
            log.info("job %s: no progress for %.1f s on this node, but the ranks of node %s are working: not a hang "
                     "yet", job, check.stalled_s, ",".join(elsewhere), extra={"job": job})
        return replace(check, hung=False)

    def share(self, snap: JobSnapshot, incident_id: str, verdict,
              on_wait: Callable[[dict[str, dict]], None]) -> dict | None:
        """Tell the job's other nodes what this node saw and learn who records the hang: the verdicts by node
        when this node does, None when another does, {} when etcd cannot be asked (then it acts alone).
        ``on_wait``: called by the owner before it waits for verdicts that are not in yet (it aborts the workers
        here: a partitioned node never answers, and the round after would wait for the owner's workers)."""
        local = {"verdict": verdict.to_dict(), "last_steps": {str(r.rank): r.last_step for r in snap.ranks}}
        try:
            owns, answer = self._cluster.coordinate(snap.job, hang_key(snap), incident_id, local, on_wait=on_wait)
        except Exception as exc:
            log.warning("job %s: cannot coordinate the hang with the other nodes through etcd (%s); recording it "
                        "here", snap.job, exc, extra={"job": snap.job})
            return {}
        if owns:
            return answer
        log.warning("job %s hung; node %s records it (incident %s); aborting this node's workers", snap.job,
                    answer.get("node", "?"), answer.get("incident", "?"), extra={"job": snap.job})
        return None

    def evidence(self, shared: dict[str, dict]) -> tuple[dict[int, str], str, dict]:
        """The culprits named by any node (rank -> node), the incident's summary and its ``cluster`` evidence from
        the verdicts the owner got; the nodes that gave none are named (a partition shorter than the membership
        lease is no node_lost, only this)."""
        named, summary = merge_verdicts(shared)
        cluster = {"verdicts": shared, "culprit_nodes": {str(r): n for r, n in named.items()}}
        silent = list(getattr(self._cluster, "unanswered", None) or [])
        if silent:
            cluster["silent_nodes"] = silent
            if not named:
                summary = (f"node {', '.join(silent)} did not answer (cut off from the others, or its agent is "
                           f"down); {summary}")
        return named, summary, cluster

    def forget(self, job: str) -> None:
        self._deferred.pop(job, None)
        self._failing.pop(job, None)
        if self.late is not None:
            self.late.forget(job)
        try:
            self._cluster.set_busy(job, False)
        except Exception:
            pass  # the beacon's lease ends it

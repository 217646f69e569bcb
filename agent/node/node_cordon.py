"""This node's cordon as the daemon's job control sees it (agent/node/job_runner.py): a GPU fault cordons and drains
the node, each new cordon is an incident of every job the node runs, and ``trainwarden_node_cordoned`` says which
kind is on.

The cordon itself lives in etcd (``nodes/<node>/cordon``, written by `trainwarden cordon`/`drain` or here); the
runner reads it through its watches each round and hands it to ``note``.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

from prometheus_client.core import GaugeMetricFamily

from trainwarden.agent.incidents.record import Incident, IncidentKind, IncidentState, new_incident_id

logger = logging.getLogger("trainwarden.agent.node.job_runner")  # the runner's log, as before the split

__all__ = ["NodeCordon"]


class NodeCordon:
    """``health()``: why this node's GPUs should not train (empty when fit); ``record``: where cordon incidents go."""

    def __init__(self, control, *, node: str, health: Callable[[], tuple[str, ...]] | None = None,
                 record: Callable[[Incident], Incident] | None = None) -> None:
        self._control, self.node, self._health, self._record = control, node, health, record
        self._seen: float | None = None  # the ``since`` of the last cordon recorded as an incident
        self.now: dict | None = None  # as last read from etcd (for the metrics)

    def if_unfit(self) -> dict | None:
        """A GPU fault (a fatal XID, an uncorrected ECC error, a GPU lost: ``health()``) drains the node: its
        jobs go on without it, and it stays cordoned until an operator uncordons it."""
        reasons = self._health() if self._health is not None else ()
        if not reasons:
            return None
        reason = "GPU fault: " + "; ".join(reasons)
        logger.error("node %s: %s; cordoning and draining it (`trainwarden uncordon %s` once it is repaired)",
                     self.node, reason, self.node)
        self._control.cordon(self.node, reason[:500], by=f"trainwarden agent on {self.node}", drain=True)
        return self._control.cordoned(self.node)

    def note(self, cordon: dict | None, jobs: Iterable[str]) -> None:
        """The round's cordon; each new one is an incident of every job in ``jobs`` (with who and why)."""
        self.now = cordon
        since = float(cordon.get("since") or 0.0) if cordon else None
        if since is None or since == self._seen:
            self._seen = since
            return
        self._seen = since
        drain = bool(cordon.get("drain"))
        action = ("draining: its jobs leave it after a checkpoint at a step boundary" if drain
                  else "cordoned: no new work starts on this node; running jobs go on")
        logger.warning("node %s %s by %s: %s", self.node, "drained" if drain else "cordoned", cordon.get("by", "?"),
                       cordon.get("reason", ""))
        if self._record is None:
            return
        for job in sorted(jobs):
            try:
                self._record(Incident(id=new_incident_id(), kind=IncidentKind.CORDONED, job=job, node=self.node,
                                      evidence={"reason": cordon.get("reason", ""), "by": cordon.get("by", ""),
                                                "drain": drain, "since": since},
                                      detected_at=time.time(), state=IncidentState.RESOLVED, action=action))
            except Exception:
                logger.exception("cannot record the cordon of node %s for job %s", self.node, job)

    def metric(self) -> GaugeMetricFamily:
        """``trainwarden_node_cordoned{node, kind}``: 1 while cordoned; kind ``cordon`` or ``drain``, 0 under both
        when in service."""
        cordoned = GaugeMetricFamily("trainwarden_node_cordoned", "1 while the node is cordoned (kind=drain: its "
                                     "jobs leave it too), as the daemon last read it from etcd",
                                     labels=["node", "kind"])
        for kind in ("cordon", "drain"):
            on = self.now is not None and bool(self.now.get("drain")) == (kind == "drain")
            cordoned.add_metric([self.node, kind], 1.0 if on else 0.0)
        return cordoned

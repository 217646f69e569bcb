"""A job's hot spares as Prometheus sees them (issue 47): whether this node waits as a spare, and the swaps it made.

Every node's launcher exports its own part, as it exports its goodput ledger, so the job's figures are sums over
its nodes and a node that is gone takes its series with it:

    trainwarden_job_spare_nodes{job,node}          gauge    1 while this node waits as a hot spare, else 0
    trainwarden_spare_swaps_total{job,node,cause}  counter  swaps this node made as a spare, by what it replaced

``sum by (job) (trainwarden_job_spare_nodes)`` is the number of spares waiting; a swap is counted once, on the spare
that took the ranks. ``cause`` is ``node_lost`` (it named itself in the lost node's ``node_lost`` incident:
agent/incidents/spare_takeover.py), ``excluded`` (it took the place of a node that an exclude policy sent away, as
the round's leave record says, and recorded a ``spare_swap`` incident) or ``drained`` (the same for a node that was
drained, SIGUSR1). No torch here.
"""

from __future__ import annotations

import threading
from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["SWAP_CAUSES", "SpareSwaps"]

SWAP_CAUSES = ("node_lost", "excluded", "drained")
"""What a spare replaced: every cause is exported, from 0."""


class SpareSwaps:
    """This node's spare state and swaps in one job; a prometheus_client collector (module docstring)."""

    def __init__(self, job: str, *, node: str) -> None:
        if not job or not node:
            raise ValueError("SpareSwaps needs the job's name and this node's")
        self.job, self.node = job, node
        self._lock = threading.Lock()
        self._waiting = False
        self._swaps = dict.fromkeys(SWAP_CAUSES, 0)

    def waiting(self, spare: bool) -> None:
        """This node waits as a spare (``True``: the round closed without it) or trains (``False``)."""
        with self._lock:
            self._waiting = bool(spare)

    def swapped(self, cause: str) -> None:
        """This node, a spare, took the ranks of a node that was lost (``node_lost``), excluded or drained."""
        if cause not in SWAP_CAUSES:
            raise ValueError(f"swap cause {cause!r}: expected one of {', '.join(SWAP_CAUSES)}")
        with self._lock:
            self._swaps[cause] += 1

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            waiting, swaps = self._waiting, dict(self._swaps)
        labels = [self.job, self.node]
        spares = GaugeMetricFamily("trainwarden_job_spare_nodes", "1 while this node waits in the job's rendezvous "
                                   "as a hot spare, else 0 (sum by job: the job's spares waiting)",
                                   labels=["job", "node"])
        spares.add_metric(labels, 1.0 if waiting else 0.0)
        yield spares
        counted = CounterMetricFamily("trainwarden_spare_swaps", "Swaps this node made as a hot spare: it took the "
                                      "ranks of a node that was lost, excluded or drained, by cause", labels=["job", "node",
                                                                                                     "cause"])
        for cause in SWAP_CAUSES:
            counted.add_metric([*labels, cause], swaps[cause])
        yield counted

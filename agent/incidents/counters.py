"""Incident counters for Prometheus: ``trainwarden_hangs_total{job,node}`` and
``trainwarden_incidents_total{job,node,kind}``. ``IncidentStore`` counts into an ``IncidentCollector``
registered on the registry the caller passes (never the global one).
"""

from __future__ import annotations

import threading
from typing import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from trainwarden.agent.incidents.record import IncidentKind

__all__ = ["IncidentCollector"]


class IncidentCollector(Collector):
    """Incident counters; `IncidentStore` counts into it, Prometheus scrapes it."""

    def __init__(self, *, node: str) -> None:
        self._node = node
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}

    def count(self, job: str, kind: IncidentKind) -> None:
        with self._lock:
            key = (job, IncidentKind(kind).value)
            self._counts[key] = self._counts.get(key, 0) + 1

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts = dict(self._counts)
        hangs = CounterMetricFamily("trainwarden_hangs", "Hangs detected by the watchdog.", labels=["job", "node"])
        incidents = CounterMetricFamily("trainwarden_incidents", "Incidents recorded, by kind.",
                                        labels=["job", "node", "kind"])
        for job in sorted({j for j, _ in counts}):
            hangs.add_metric([job, self._node], counts.get((job, IncidentKind.HANG.value), 0))
        for (job, kind), n in sorted(counts.items()):
            incidents.add_metric([job, self._node, kind], n)
        yield hangs
        yield incidents

"""Incident counters for Prometheus: ``trainwarden_hangs_total{job,node}`` and
``trainwarden_incidents_total{job,node,kind}``. ``IncidentStore`` counts into an ``IncidentCollector``
registered on the registry the caller passes (never the global one).

Every kind of a job the node runs is exported from the start, at 0: a counter that is born at 1 shows no
``increase()`` or ``changes()``, so the first incident of each kind would be missing from the dashboards'
incident annotations and panels.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from trainwarden.agent.incidents.record import IncidentKind

__all__ = ["IncidentCollector"]


class IncidentCollector(Collector):
    """Incident counters; `IncidentStore` counts into it, Prometheus scrapes it."""

    def __init__(self, *, node: str, jobs: Callable[[], Iterable[str]] = tuple) -> None:
        """``jobs``: the names of the jobs the node runs now (read at scrape time); each is exported with every
        kind at 0 before its first incident."""
        self._node = node
        self._jobs = jobs
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
        for job in sorted({j for j, _ in counts} | set(self._jobs())):
            hangs.add_metric([job, self._node], counts.get((job, IncidentKind.HANG.value), 0))
            for kind in IncidentKind:
                incidents.add_metric([job, self._node, kind.value], counts.get((job, kind.value), 0))
        yield hangs
        yield incidents

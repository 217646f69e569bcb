"""The agent's Prometheus endpoint: one registry of collectors served on ``/metrics``.

Design
------
The agent builds one ``CollectorRegistry`` (``build_registry``) from its collectors (GPU health, host
health, the watchdog's and telemetry's own, and ``AgentInfoCollector`` for the agent itself) and serves it
with ``MetricsExporter``. Collectors yield metric families at scrape time from state their own threads keep
up to date, so a scrape is cheap and never blocks on a device. There is no global registry: tests and the
all-in-one ``trainwarden run`` each build their own, so nothing leaks between them.

``MetricsExporter`` serves prometheus_client's ``MetricsHandler`` on a ``BoundedHTTPServer``
(agent/common/bounded_http.py): at most ``max_threads`` scrapes are served at once, a connection that says
nothing for ``idle_timeout_s`` is closed without ever holding a thread, so idle connections from anyone who
reaches the port cost the daemon no threads. The exporter keeps the server and its thread, so ``stop()`` shuts
the server down, closes the socket and joins the thread. Port 0 picks a free port (``.port`` then tells which).

Default port: ``DEFAULT_METRICS_PORT = 9478``. Prometheus's wiki of default exporter ports has handed
out all of 9100-9999, so no number there is unclaimed; 9478 keeps clear of what runs on a GPU training
node: Prometheus 9090, Pushgateway 9091, Alertmanager 9093, node_exporter 9100, dcgm-exporter 9400, the
OpenTelemetry Prometheus exporter 9464, nvidia_gpu_exporter 9835, etcd 2379/2380 and torchrun
29400/29500. Override it with the agent's metrics-port setting where it collides.

The default bind address is loopback: exposing metrics to the network is an explicit choice
(``host="0.0.0.0"``) for the deployment to make.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from typing import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import MetricsHandler
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from trainwarden.agent import __version__
from trainwarden.agent.common.bounded_http import BoundedHTTPServer

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_METRICS_PORT",
    "AgentInfoCollector",
    "ExporterError",
    "MergingRegistry",
    "MetricsExporter",
    "build_registry",
]

DEFAULT_METRICS_PORT = 9478


class ExporterError(RuntimeError):
    """The metrics endpoint could not be served (e.g. its port is taken); retrying the same port won't help."""


class AgentInfoCollector:
    """The agent's own identity: ``trainwarden_agent_info{node,version} 1`` and its start time."""

    def __init__(self, *, node: str, version: str = __version__, wall_clock: Callable[[], float] = time.time) -> None:
        self._node = node
        self._version = version
        self._started_at = wall_clock()  # wall clock: a timestamp for people, not a duration

    def collect(self) -> Iterator[Metric]:
        info = InfoMetricFamily("trainwarden_agent", "The trainwarden agent serving these metrics.", labels=["node"])
        info.add_metric([self._node], {"version": self._version})
        yield info
        started = GaugeMetricFamily(
            "trainwarden_agent_start_time_seconds", "Unix time the agent started.", labels=["node"]
        )
        started.add_metric([self._node], self._started_at)
        yield started


class MergingRegistry(CollectorRegistry):
    """A registry whose exposition holds each family once, however many collectors yield it: the daemon's own
    families and those it relays from its jobs' launchers (agent/metrics/relay.py) share names. A series that two
    collectors both yield (the same name and labels) is a counter of events both count on this node (incidents of a
    job, recorded by the daemon and by the job's launcher): its values add up; for any other type the first wins."""

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for family in super().collect():
            first = merged.get(family.name)
            if first is None:
                merged[family.name] = family
            elif first.type == family.type:
                merged[family.name] = _merged(first, family)
            else:
                logger.debug("family %s is a %s and a %s; keeping the %s", family.name, first.type, family.type,
                             first.type)
        yield from merged.values()


def _merged(first: Metric, other: Metric) -> Metric:
    add = first.type == "counter"
    out = Metric(first.name, first.documentation, first.type, first.unit)
    index: dict[tuple, int] = {}
    samples = []
    for sample in [*first.samples, *other.samples]:
        key = (sample.name, tuple(sorted(sample.labels.items())))
        at = index.get(key)
        if at is None:
            index[key] = len(samples)
            samples.append(sample)
        elif add and sample.name.endswith("_total"):
            samples[at] = samples[at]._replace(value=samples[at].value + sample.value)
    out.samples = samples
    return out


def build_registry(collectors: Iterable[Collector]) -> CollectorRegistry:
    """A fresh registry holding exactly ``collectors`` (anything with ``collect()``), each family exposed once."""
    registry = MergingRegistry()
    for collector in collectors:
        registry.register(collector)
    return registry


class MetricsExporter:
    """Serves ``registry`` on ``http://host:port/metrics`` from a daemon thread until ``stop()``."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = DEFAULT_METRICS_PORT, *,
                 max_threads: int = 8, idle_timeout_s: float = 5.0, request_timeout_s: float = 10.0) -> None:
        """``max_threads``: scrapes served at once; ``idle_timeout_s``: how long a connection may say nothing;
        ``request_timeout_s``: how long a read or write of one request may wait (agent/common/bounded_http.py)."""
        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be 0..65535 (0 picks a free one), got {port!r}")
        self._limits = {"max_threads": max_threads, "idle_timeout_s": idle_timeout_s,
                        "request_timeout_s": request_timeout_s}
        BoundedHTTPServer.check_limits(**self._limits)
        self._registry = registry
        self._host = host
        self._requested_port = port
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port being served (the one picked when 0 was asked for); the requested one before start."""
        if self._server is None:
            return self._requested_port
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> "MetricsExporter":
        """Bind and serve. Raises ExporterError if the address cannot be bound."""
        if self._server is not None:
            raise ExporterError(f"metrics exporter already serving {self.url}")
        try:
            server = BoundedHTTPServer((self._host, self._requested_port), MetricsHandler.factory(self._registry),
                                       name="trainwarden-metrics", **self._limits)
        except OSError as err:
            hint = (
                "another process holds it: stop it or choose another metrics port"
                if err.errno == errno.EADDRINUSE
                else "check the metrics host setting"
            )
            where = f"{self._host}:{self._requested_port}"
            raise ExporterError(f"cannot serve metrics on {where}: {err.strerror}; {hint}") from err
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, args=(0.1,), name="trainwarden-metrics",
                                        daemon=True)
        self._thread.start()
        logger.info("serving Prometheus metrics on %s", self.url)
        return self

    @property
    def serving(self) -> bool:
        """True while the server thread runs (it serves each scrape on a thread of its own)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving, close the socket and join the server thread. Safe to call twice."""
        server, thread = self._server, self._thread
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout_s)
        self._server = self._thread = None

    def __enter__(self) -> "MetricsExporter":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

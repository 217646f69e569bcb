"""MetricsExporter and build_registry: serving, stopping, port conflicts, the agent's own metrics."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from trainwarden.agent import __version__
from trainwarden.agent.metrics.exporter import (
    DEFAULT_METRICS_PORT,
    AgentInfoCollector,
    ExporterError,
    MetricsExporter,
    build_registry,
)

pytestmark = pytest.mark.timeout(30)


class Constant:
    def __init__(self, value: float) -> None:
        self.value = value

    def collect(self):
        family = GaugeMetricFamily("trainwarden_test_value", "A test value.", labels=["node"])
        family.add_metric(["n1"], self.value)
        yield family


def fetch(url: str) -> dict[str, dict[frozenset, float]]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    out: dict[str, dict[frozenset, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
    return out


def test_serves_registry_at_scrape_time_and_stops():
    value = Constant(1.0)
    registry = build_registry([value, AgentInfoCollector(node="n1", wall_clock=lambda: 1700000000.0)])
    exporter = MetricsExporter(registry, port=0).start()
    try:
        assert exporter.port != 0 and exporter.url == f"http://127.0.0.1:{exporter.port}/metrics"
        m = fetch(exporter.url)
        assert m["trainwarden_test_value"] == {frozenset({("node", "n1")}): 1.0}
        assert m["trainwarden_agent_info"] == {frozenset({("node", "n1"), ("version", __version__)}): 1.0}
        assert m["trainwarden_agent_start_time_seconds"] == {frozenset({("node", "n1")}): 1700000000.0}
        value.value = 2.0  # collectors are read per scrape
        assert fetch(exporter.url)["trainwarden_test_value"] == {frozenset({("node", "n1")}): 2.0}
        url, thread = exporter.url, exporter._thread
    finally:
        exporter.stop()
    assert not thread.is_alive()
    with pytest.raises(urllib.error.URLError):
        fetch(url)
    exporter.stop()  # twice is fine


def test_context_manager_and_only_the_given_collectors():
    with MetricsExporter(build_registry([Constant(5.0)]), port=0) as exporter:
        m = fetch(exporter.url)
    assert set(m) == {"trainwarden_test_value"}  # no process/platform defaults from the global registry


def test_port_in_use_is_a_clear_error():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ExporterError, match=f"127.0.0.1:{port}.*another process holds it"):
            MetricsExporter(build_registry([]), port=port).start()


def test_start_twice_and_bad_port_are_rejected():
    with pytest.raises(ValueError, match="0..65535"):
        MetricsExporter(build_registry([]), port=70000)
    with MetricsExporter(build_registry([]), port=0) as exporter:
        with pytest.raises(ExporterError, match="already serving"):
            exporter.start()


def test_default_port_avoids_well_known_exporters():
    assert DEFAULT_METRICS_PORT not in (9090, 9091, 9093, 9100, 9400, 9464, 9835)
    assert MetricsExporter(build_registry([])).port == DEFAULT_METRICS_PORT

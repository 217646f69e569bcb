"""LauncherRelay and the merging registry: the daemon's endpoint carries each running job's own series, once."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from trainwarden.agent.metrics import LauncherRelay, build_registry
from trainwarden.agent.metrics.job_collector import JobMetricsCollector
from trainwarden.agent.telemetry.job_telemetry import JobTelemetry

pytestmark = pytest.mark.timeout(30)

LAUNCHER_A = """\
# HELP trainwarden_last_step Index of the rank's last finished step.
# TYPE trainwarden_last_step gauge
trainwarden_last_step{job="a",node="n1",rank="0"} 12.0
trainwarden_last_step{job="a",node="n1",rank="1"} 11.0
# HELP trainwarden_step_duration_seconds Training step duration per rank.
# TYPE trainwarden_step_duration_seconds histogram
trainwarden_step_duration_seconds_bucket{job="a",node="n1",rank="0",le="0.1"} 3.0
trainwarden_step_duration_seconds_bucket{job="a",node="n1",rank="0",le="+Inf"} 12.0
trainwarden_step_duration_seconds_count{job="a",node="n1",rank="0"} 12.0
trainwarden_step_duration_seconds_sum{job="a",node="n1",rank="0"} 2.5
# HELP trainwarden_incidents_total Incidents recorded, by kind.
# TYPE trainwarden_incidents_total counter
trainwarden_incidents_total{job="a",kind="cordoned",node="n1"} 1.0
# HELP trainwarden_gpu_up GPU seen.
# TYPE trainwarden_gpu_up gauge
trainwarden_gpu_up{node="n1",gpu="0"} 1.0
# HELP trainwarden_agent_info The trainwarden agent serving these metrics.
# TYPE trainwarden_agent_info gauge
trainwarden_agent_info{node="n1",version="1"} 1.0
"""
LAUNCHER_B = LAUNCHER_A.replace('job="a"', 'job="b"').replace("12.0", "40.0")


class Incidents:
    """The daemon's own incident counter for job a (a cordon it recorded)."""

    def collect(self):
        family = CounterMetricFamily("trainwarden_incidents", "Incidents recorded, by kind.",
                                     labels=["job", "node", "kind"])
        family.add_metric(["a", "n1", "cordoned"], 2)
        yield family


def samples(registry) -> dict[tuple, float]:
    text = generate_latest(registry).decode()
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(names) == len(set(names)), f"a family exposed twice: {sorted(names)}"
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def relay(targets: dict[str, str], bodies: dict[str, str]) -> LauncherRelay:
    def fetch(url: str, timeout_s: float) -> str:
        if url not in bodies:
            raise ConnectionRefusedError(111, "Connection refused")
        return bodies[url]

    return LauncherRelay(lambda: targets, node="n1", fetch=fetch)


def test_each_jobs_series_are_relayed_once_beside_the_daemons_own_and_its_node_series_are_left_out():
    targets = {"a": "http://127.0.0.1:1/metrics", "b": "http://127.0.0.1:2/metrics"}
    bodies = {targets["a"]: LAUNCHER_A, targets["b"]: LAUNCHER_B}
    registry = build_registry([JobMetricsCollector(JobTelemetry(), node="n1"), relay(targets, bodies)])
    got = samples(registry)
    rank0 = (("job", "a"), ("node", "n1"), ("rank", "0"))
    assert got[("trainwarden_last_step", rank0)] == 12.0
    assert got[("trainwarden_last_step", (("job", "b"), ("node", "n1"), ("rank", "0")))] == 40.0
    assert got[("trainwarden_step_duration_seconds_count", rank0)] == 12.0
    assert got[("trainwarden_job_metrics_up", (("job", "a"), ("node", "n1")))] == 1.0
    assert not [k for k in got if k[0].startswith(("trainwarden_gpu", "trainwarden_agent_info"))]


def test_a_launcher_that_does_not_answer_costs_its_own_series_and_says_so():
    targets = {"a": "http://127.0.0.1:1/metrics", "b": "http://127.0.0.1:2/metrics", "c": ""}
    got = samples(build_registry([relay(targets, {targets["a"]: LAUNCHER_A})]))
    assert got[("trainwarden_job_metrics_up", (("job", "b"), ("node", "n1")))] == 0.0
    assert got[("trainwarden_job_metrics_up", (("job", "c"), ("node", "n1")))] == 0.0  # not serving yet
    assert not [k for k in got if dict(k[1]).get("job") == "b" and k[0] != "trainwarden_job_metrics_up"]
    assert got[("trainwarden_last_step", (("job", "a"), ("node", "n1"), ("rank", "0")))] == 12.0


def test_a_counter_both_the_daemon_and_the_launcher_count_adds_up():
    targets = {"a": "http://127.0.0.1:1/metrics"}
    got = samples(build_registry([Incidents(), relay(targets, {targets["a"]: LAUNCHER_A})]))
    assert got[("trainwarden_incidents_total", (("job", "a"), ("kind", "cordoned"), ("node", "n1")))] == 3.0


def test_a_gauge_two_collectors_yield_keeps_the_first():
    class Gauge:
        def __init__(self, value):
            self.value = value

        def collect(self):
            family = GaugeMetricFamily("trainwarden_x", "x", labels=["job"])
            family.add_metric(["a"], self.value)
            yield family

    assert samples(build_registry([Gauge(1.0), Gauge(2.0)]))[("trainwarden_x", (("job", "a"),))] == 1.0


def test_no_jobs_no_fetch():
    assert samples(build_registry([relay({}, {})])) == {}

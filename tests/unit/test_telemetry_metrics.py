"""JobMetricsCollector: families from JobTelemetry, parsed back with prometheus_client's parser."""

import shutil
import subprocess

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trainwarden.agent.metrics.job_collector import JobMetricsCollector
from trainwarden.agent.telemetry.job_telemetry import CollectiveTotals, JobTelemetry, WorkerInfo

ALLOWED_LABELS = {"job", "node", "rank", "op", "reason", "le", "kind"}  # kind: NUMERIC_KINDS, two values


def scrape(js):
    registry = CollectorRegistry()
    registry.register(JobMetricsCollector(js, node="n1"))
    text = generate_latest(registry).decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return text, samples


@pytest.mark.timeout(10)
def test_collector_exports_job_metrics_with_bounded_labels():
    js = JobTelemetry()
    for rank in (0, 1):
        js.connect(WorkerInfo(job="train", rank=rank, world_size=2, pid=100 + rank))
        for i in range(3):
            js.record_step("train", rank, index=i, start_unix=i, duration_seconds=0.2, tokens=64)
        js.record_collectives("train", rank, [
            CollectiveTotals(process_group="default_pg", op="all_reduce", count=3, wait_seconds=0.15, last_seq_id=3),
            CollectiveTotals(process_group="tp", op="all_reduce", count=3, wait_seconds=0.05, last_seq_id=3),
            CollectiveTotals(process_group="tp", op="broadcast", count=1, wait_seconds=0.1, last_seq_id=4)],
            has_durations=True)
    js.record_checkpoint("train", 0, stage="staged", step=2, seconds=0.5)
    js.record_checkpoint("train", 0, stage="committed", step=2, seconds=1.5)
    js.disconnect("train", 1, pid=101)
    js.count_rejected("oversized")

    text, samples = scrape(js)
    r0 = (("job", "train"), ("node", "n1"), ("rank", "0"))
    r1 = (("job", "train"), ("node", "n1"), ("rank", "1"))
    assert samples[("trainwarden_step_duration_seconds_count", r0)] == 3
    assert samples[("trainwarden_step_duration_seconds_bucket", tuple(sorted(r0 + (("le", "0.25"),))))] == 3
    assert samples[("trainwarden_step_duration_seconds_bucket", tuple(sorted(r0 + (("le", "0.1"),))))] == 0
    assert samples[("trainwarden_step_duration_seconds_sum", r0)] == pytest.approx(0.6)
    assert samples[("trainwarden_last_step", r0)] == 2
    assert samples[("trainwarden_tokens_total", r0)] == 192
    assert samples[("trainwarden_collective_wait_seconds_total",
                    tuple(sorted(r0 + (("op", "all_reduce"),))))] == pytest.approx(0.2)
    assert samples[("trainwarden_compute_seconds_total", r0)] == pytest.approx(0.6 - 0.3)
    assert samples[("trainwarden_collective_last_seq_id", r0)] == 4
    assert samples[("trainwarden_checkpoint_stall_seconds", r0)] == 0.5
    assert samples[("trainwarden_checkpoint_last_step", (("job", "train"), ("node", "n1")))] == 2
    assert samples[("trainwarden_worker_restarts_total", (("job", "train"), ("node", "n1")))] == 0
    assert samples[("trainwarden_worker_up", r0)] == 1 and samples[("trainwarden_worker_up", r1)] == 0
    assert samples[("trainwarden_telemetry_rejected_total", (("node", "n1"), ("reason", "oversized")))] == 1
    assert {k for _, labels in samples for k, _ in labels} <= ALLOWED_LABELS
    assert "# TYPE trainwarden_tokens_total counter" in text or "# TYPE trainwarden_tokens counter" in text


@pytest.mark.timeout(10)
def test_empty_store_exports_only_rejection_and_overflow_counters():
    _, samples = scrape(JobTelemetry())
    assert {name for name, _ in samples} == {"trainwarden_telemetry_rejected_total",
                                             "trainwarden_telemetry_overflow_total"}
    with pytest.raises(ValueError):
        JobMetricsCollector(JobTelemetry(), node="")


@pytest.mark.integration
@pytest.mark.timeout(30)
@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_accepts_the_job_metrics_exposition():
    js = JobTelemetry()
    js.connect(WorkerInfo(job="train", rank=0, world_size=1, pid=1))
    js.record_step("train", 0, index=0, start_unix=0, duration_seconds=0.3, tokens=10)
    js.record_collectives("train", 0, [CollectiveTotals(process_group="default_pg", op="all_reduce", count=1,
                                                        wait_seconds=0.1, last_seq_id=1)], has_durations=True)
    js.record_checkpoint("train", 0, stage="committed", step=0, seconds=1.0)
    text, _ = scrape(js)
    proc = subprocess.run([shutil.which("promtool"), "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=20, start_new_session=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr

"""`promtool check metrics` on the agent's real exposition, fetched over HTTP from MetricsExporter.

The collectors are the real ones: GPU health on a fake NVML (this suite runs without GPUs) with XIDs
and unsupported calls, host health on the real psutil, and the agent's own info. promtool comes with
Debian's ``prometheus`` package; the test skips, saying so, where it is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request

import pytest

from fake_nvml import NVML_ERROR_NOT_SUPPORTED, FakeGpu, FakeNvml
from trainwarden.agent.metrics.exporter import AgentInfoCollector, MetricsExporter, build_registry
from trainwarden.agent.health import GpuHealthConfig, GpuHealthSampler, HostHealthConfig, HostHealthSampler

PROMTOOL = shutil.which("promtool")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(60),
    pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)"),
]


def promtool_check(text: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30,
        start_new_session=True,
    )


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def test_promtool_accepts_the_agent_exposition():
    fake = FakeNvml([
        FakeGpu(uuid="GPU-aaaa"),
        FakeGpu(uuid="GPU-bbbb", ecc_uncorrected=1, errors={"nvmlDeviceGetPowerUsage": NVML_ERROR_NOT_SUPPORTED}),
    ])
    fake.push_xid(0, 79)
    fake.push_xid(1, 48)
    gpus = GpuHealthSampler(GpuHealthConfig(node="n1", interval_s=0.1, xid_wait_s=0.1), nvml=fake)
    host = HostHealthSampler(HostHealthConfig(node="n1", interval_s=0.1), worker_pids=lambda: [os.getpid()])
    collectors = [gpus, host, AgentInfoCollector(node="n1")]
    gpus.start()
    host.start()
    try:
        with MetricsExporter(build_registry(collectors), host="127.0.0.1", port=0) as exporter:
            deadline = time.monotonic() + 20
            while not (sum(gpus.xid_counts().values()) == 2 and gpus.samples and host.latest):
                assert time.monotonic() < deadline, "samplers produced nothing"
                time.sleep(0.02)
            text = scrape(exporter.url)
    finally:
        gpus.stop()
        host.stop()
    for name in (
        "trainwarden_gpu_utilization_ratio", "trainwarden_gpu_xid_errors_total", "trainwarden_gpu_clock_event_active",
        "trainwarden_host_network_receive_bytes_total", "trainwarden_host_worker_processes", "trainwarden_agent_info",
    ):
        assert f"\n{name}{{" in text, name
    result = promtool_check(text)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), result


def test_promtool_accepts_the_no_gpu_exposition_and_does_lint():
    gpus = GpuHealthSampler(GpuHealthConfig(node="n1"), nvml=FakeNvml([]))
    gpus.start()
    with MetricsExporter(build_registry([gpus, AgentInfoCollector(node="n1")]), port=0) as exporter:
        text = scrape(exporter.url)
    gpus.stop()
    assert 'trainwarden_gpu_monitoring_available{node="n1"} 0.0' in text
    result = promtool_check(text)
    assert result.returncode == 0, result
    # the check has teeth: a counter without _total is rejected
    bad = promtool_check("# HELP trainwarden_bad A counter.\n# TYPE trainwarden_bad counter\ntrainwarden_bad 1\n")
    assert bad.returncode != 0 and "_total" in bad.stdout + bad.stderr

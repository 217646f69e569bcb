"""Host health sampler against a fake psutil: values, bounded interface labels, partial failures."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trainwarden.agent.metrics.exporter import build_registry
from trainwarden.agent.health import HostHealthConfig, HostHealthSampler

pytestmark = pytest.mark.timeout(30)

GiB = 2**30


class FakePsutil:
    """The slice of psutil the host sampler uses, with canned values."""

    class Error(Exception):
        pass

    class NoSuchProcess(Error):
        pass

    def __init__(self, nics=("lo", "eth0", "ib0", "veth1a2b", "docker0")):
        self.cpu = iter([0.0, 25.0, 50.0, 75.0, 75.0, 75.0, 75.0])
        self.nics = nics
        self.memory_error: Exception | None = None
        self.rss = {101: 2 * GiB, 102: 3 * GiB}

    def cpu_percent(self, interval=None):
        assert interval is None  # a blocking interval would stall the sampler thread
        return next(self.cpu)

    def getloadavg(self):
        return (1.5, 1.0, 0.5)

    def virtual_memory(self):
        if self.memory_error is not None:
            raise self.memory_error
        return SimpleNamespace(total=64 * GiB, used=20 * GiB, available=40 * GiB)

    def disk_usage(self, path):
        if path == "/missing":
            raise FileNotFoundError(2, "No such file or directory", path)
        return SimpleNamespace(used=100 * GiB, total=400 * GiB)

    def net_io_counters(self, pernic=False):
        assert pernic
        return {n: SimpleNamespace(bytes_recv=1000 + i, bytes_sent=2000 + i) for i, n in enumerate(self.nics)}

    def Process(self, pid):
        if pid not in self.rss:
            raise self.NoSuchProcess(pid)
        return SimpleNamespace(memory_info=lambda: SimpleNamespace(rss=self.rss[pid]))


def scrape(collector) -> dict[str, dict[frozenset, float]]:
    text = generate_latest(build_registry([collector])).decode()
    out: dict[str, dict[frozenset, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.get("node") == "n1", s
            out.setdefault(s.name, {})[frozenset((k, v) for k, v in s.labels.items() if k != "node")] = s.value
    return out


def L(**labels) -> frozenset:
    return frozenset(labels.items())


def host(fake, **config) -> HostHealthSampler:
    return HostHealthSampler(HostHealthConfig(node="n1", interval_s=0.05, **config), psutil=fake)


def test_values_units_and_labels():
    sampler = HostHealthSampler(
        HostHealthConfig(node="n1", disk_paths=("/", "/ckpt")), psutil=FakePsutil(), worker_pids=lambda: [101, 102, 999]
    )
    sampler.sample()
    m = scrape(sampler)
    assert m["trainwarden_host_cpu_utilization_ratio"] == {L(): 0.25}  # the priming call's 0.0 is not reported
    assert m["trainwarden_host_load_average"] == {L(period="1m"): 1.5, L(period="5m"): 1.0, L(period="15m"): 0.5}
    assert m["trainwarden_host_memory_total_bytes"] == {L(): 64 * GiB}
    assert m["trainwarden_host_memory_used_bytes"] == {L(): 20 * GiB}
    assert m["trainwarden_host_memory_available_bytes"] == {L(): 40 * GiB}
    assert m["trainwarden_host_disk_used_bytes"] == {L(mountpoint="/"): 100 * GiB, L(mountpoint="/ckpt"): 100 * GiB}
    assert m["trainwarden_host_disk_total_bytes"][L(mountpoint="/")] == 400 * GiB
    assert m["trainwarden_host_network_receive_bytes_total"] == {L(interface="eth0"): 1001, L(interface="ib0"): 1002}
    assert m["trainwarden_host_network_transmit_bytes_total"] == {L(interface="eth0"): 2001, L(interface="ib0"): 2002}
    assert m["trainwarden_host_worker_processes"] == {L(): 2.0}  # pid 999 has exited
    assert m["trainwarden_host_worker_resident_memory_bytes"] == {L(): 5 * GiB}
    assert m["trainwarden_host_sample_errors_total"] == {L(): 0.0}


def test_interfaces_are_capped_and_can_be_chosen():
    many = tuple(f"eth{i:02d}" for i in range(40)) + ("lo",)
    capped = host(FakePsutil(nics=many), max_interfaces=4)
    capped.sample()
    assert sorted(capped.latest.network) == ["eth00", "eth01", "eth02", "eth03"]
    chosen = host(FakePsutil(), interfaces=("ib0", "absent0"))
    chosen.sample()
    assert list(chosen.latest.network) == ["ib0"]


def test_a_missing_disk_or_load_average_drops_only_that_reading(caplog):
    class NoLoadAverage(FakePsutil):  # a platform without load averages
        @property
        def getloadavg(self):
            raise AttributeError("getloadavg")

    sampler = host(NoLoadAverage(), disk_paths=("/missing", "/"))
    sampler.sample()
    sampler.sample()
    m = scrape(sampler)
    assert m["trainwarden_host_disk_used_bytes"] == {L(mountpoint="/"): 100 * GiB}
    assert "trainwarden_host_load_average" not in m
    assert "trainwarden_host_memory_used_bytes" in m
    assert caplog.text.count("cannot read disk /missing") == 1  # logged once, not every sample
    assert m["trainwarden_host_sample_errors_total"] == {L(): 0.0}


def test_one_bad_sample_is_logged_the_previous_kept_and_the_thread_survives(caplog):
    fake = FakePsutil()
    now = [100.0]
    sampler = HostHealthSampler(
        HostHealthConfig(node="n1", interval_s=0.02), psutil=fake, clock=lambda: now[0]
    )
    assert sampler._sampler.sample_once()
    now[0] = 103.0
    fake.memory_error = ValueError("corrupt /proc/meminfo")
    assert not sampler._sampler.sample_once()
    m = scrape(sampler)
    assert m["trainwarden_host_sample_errors_total"] == {L(): 1.0}
    assert m["trainwarden_host_memory_used_bytes"] == {L(): 20 * GiB}  # the previous sample is kept
    assert m["trainwarden_host_sample_age_seconds"] == {L(): 3.0}
    assert "corrupt /proc/meminfo" in caplog.text

    sampler.start()  # the thread keeps sampling through failures
    deadline = time.monotonic() + 10
    while sampler._sampler.errors < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    fake.memory_error = None
    errors = sampler._sampler.errors
    while sampler._sampler.last_success == 100.0 and time.monotonic() < deadline:
        now[0] += 1
        time.sleep(0.01)
    sampler.stop()
    assert errors >= 3 and sampler._sampler.last_success != 100.0
    assert not [t for t in threading.enumerate() if t.name == "trainwarden-host-health"]


@pytest.mark.parametrize("kwargs", [{"interval_s": -1}, {"max_interfaces": -1}, {"disk_paths": "/"}, {"node": ""}])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match="HostHealthConfig"):
        HostHealthConfig(**{"node": "n1", **kwargs})

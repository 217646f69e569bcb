"""GPU health sampler against a fake NVML: values, labels, unsupported calls, XIDs, no-GPU, failures."""

from __future__ import annotations

import sys
import threading
import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fake_nvml import (
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    FakeGpu,
    FakeHandle,
    FakeNvml,
)
from trainwarden.agent.metrics.exporter import build_registry
from trainwarden.agent.health import GpuHealthConfig, GpuHealthSampler
from trainwarden.agent.health.xid import XidListener

pytestmark = pytest.mark.timeout(30)


def scrape(*collectors) -> dict[str, dict[frozenset, float]]:
    """Sample name -> {frozenset of labels without node: value}, through the text exposition."""
    text = generate_latest(build_registry(collectors)).decode()
    out: dict[str, dict[frozenset, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.get("node") == "n1", s
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "node")
            out.setdefault(s.name, {})[labels] = s.value
    return out


def L(**labels) -> frozenset:
    return frozenset(labels.items())


def two_gpus() -> list[FakeGpu]:
    return [
        FakeGpu(uuid="GPU-aaaa"),
        FakeGpu(uuid="GPU-bbbb", util_gpu=12, temperature=45, clock_reasons=0x1, ecc_corrected=0, pcie_replays=0),
    ]


def sampler(nvml, **config) -> GpuHealthSampler:
    return GpuHealthSampler(GpuHealthConfig(node="n1", interval_s=0.05, xid_wait_s=0.05, **config), nvml=nvml)


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


def test_values_units_and_labels():
    gpus = sampler(FakeNvml(two_gpus()))
    assert gpus.open()
    gpus.sample()
    m = scrape(gpus)
    assert m["trainwarden_gpu_monitoring_available"] == {L(): 1.0}
    assert m["trainwarden_gpu_monitoring_info"] == {L(reason="ok"): 1.0}
    assert m["trainwarden_gpu_info"][L(gpu="0", uuid="GPU-aaaa", name="NVIDIA H100 80GB HBM3")] == 1.0
    assert m["trainwarden_gpu_utilization_ratio"] == {L(gpu="0"): 0.87, L(gpu="1"): 0.12}
    assert m["trainwarden_gpu_memory_busy_ratio"][L(gpu="0")] == 0.40
    assert m["trainwarden_gpu_memory_used_bytes"][L(gpu="0")] == 30 * 2**30
    assert m["trainwarden_gpu_memory_total_bytes"][L(gpu="1")] == 80 * 2**30
    assert m["trainwarden_gpu_temperature_celsius"] == {L(gpu="0"): 71.0, L(gpu="1"): 45.0}
    assert m["trainwarden_gpu_power_usage_watts"][L(gpu="0")] == 250.0
    assert m["trainwarden_gpu_sm_clock_hertz"][L(gpu="0")] == 1.41e9
    reasons = m["trainwarden_gpu_clock_event_active"]
    assert reasons[L(gpu="0", reason="hw_thermal_slowdown")] == 1.0
    assert reasons[L(gpu="0", reason="sw_power_cap")] == 1.0
    assert reasons[L(gpu="0", reason="gpu_idle")] == 0.0
    assert reasons[L(gpu="1", reason="gpu_idle")] == 1.0
    assert sum(reasons.values()) == 3.0 and len(reasons) == 2 * 9
    assert m["trainwarden_gpu_ecc_errors_total"][L(gpu="0", type="corrected")] == 3.0
    assert m["trainwarden_gpu_ecc_errors_total"][L(gpu="0", type="uncorrected")] == 0.0
    assert m["trainwarden_gpu_remapped_rows"][L(gpu="0", type="correctable")] == 2.0
    assert m["trainwarden_gpu_row_remap_pending"][L(gpu="0")] == 0.0
    assert m["trainwarden_gpu_row_remap_failed"][L(gpu="0")] == 0.0
    assert m["trainwarden_gpu_pcie_replays_total"] == {L(gpu="0"): 5.0, L(gpu="1"): 0.0}
    assert m["trainwarden_gpu_healthy"] == {L(gpu="0"): 1.0, L(gpu="1"): 1.0}
    assert gpus.unhealthy_reasons() == ()


def test_unsupported_calls_are_left_out_per_gpu_and_not_retried():
    fake = FakeNvml(two_gpus())
    unsupported = ("nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows")
    fake.gpus[1].errors = {name: NVML_ERROR_NOT_SUPPORTED for name in unsupported}
    gpus = sampler(fake)
    gpus.open()
    gpus.sample()
    gpus.sample()
    m = scrape(gpus)
    assert m["trainwarden_gpu_power_usage_watts"] == {L(gpu="0"): 250.0}
    assert set(m["trainwarden_gpu_ecc_errors_total"]) == {L(gpu="0", type="corrected"), L(gpu="0", type="uncorrected")}
    assert set(m["trainwarden_gpu_remapped_rows"]) == {L(gpu="0", type="correctable"), L(gpu="0", type="uncorrectable")}
    assert m["trainwarden_gpu_temperature_celsius"][L(gpu="1")] == 45.0  # the rest of GPU 1 still reported
    assert m["trainwarden_gpu_read_errors_total"] == {L(gpu="0"): 0.0, L(gpu="1"): 0.0}
    # GPU 0 asked twice per sample; GPU 1 once in total, then remembered as unsupported
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 2 + 1
    assert fake.calls["nvmlDeviceGetTotalEccErrors"] == 2 * 2 + 2


def test_clock_event_reasons_fall_back_to_the_deprecated_throttle_call():
    fake = FakeNvml([FakeGpu(errors={"nvmlDeviceGetCurrentClocksEventReasons": NVML_ERROR_FUNCTION_NOT_FOUND})])
    gpus = sampler(fake)
    gpus.open()
    gpus.sample()
    gpus.sample()
    assert gpus.samples[0].clock_event_reasons == 0x44
    assert fake.calls["nvmlDeviceGetCurrentClocksEventReasons"] == 1
    assert fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 2


def test_xid_events_are_counted_and_make_the_gpu_unhealthy_then_stop_joins():
    fake = FakeNvml(two_gpus())
    fake.push_xid(0, 79)
    fake.push_xid(1, 48)
    fake.push_xid(1, 48)
    gpus = sampler(fake)
    gpus.start()
    try:
        wait_until(lambda: sum(gpus.xid_counts().values()) == 3 and len(gpus.samples) == 2)
        m = scrape(gpus)
        reasons = gpus.unhealthy_reasons()
    finally:
        gpus.stop()
    assert fake.registered == [0, 1]
    assert m["trainwarden_gpu_xid_monitoring_available"] == {L(): 1.0}
    assert m["trainwarden_gpu_xid_errors_total"] == {L(gpu="0", xid="79"): 1.0, L(gpu="1", xid="48"): 2.0}
    assert m["trainwarden_gpu_healthy"] == {L(gpu="0"): 0.0, L(gpu="1"): 0.0}
    assert any(r.startswith("gpu 0: XID 79") and "fallen off the bus" in r for r in reasons), reasons
    assert any(r.startswith("gpu 1: XID 48") for r in reasons), reasons
    assert not [t for t in threading.enumerate() if t.name.startswith("trainwarden-gpu")]
    assert fake.freed and fake.shut_down
    after = scrape(gpus)
    assert after["trainwarden_gpu_monitoring_info"] == {L(reason="stopped"): 1.0}
    assert "trainwarden_gpu_utilization_ratio" not in after  # no stale GPU series after stop


def test_xid_series_are_capped_and_gpu_found_by_uuid_when_index_is_unsupported():
    fake = FakeNvml([FakeGpu(uuid="GPU-aaaa", errors={"nvmlDeviceGetIndex": NVML_ERROR_NOT_SUPPORTED})])
    listener = XidListener(fake, [(0, FakeHandle(0), "GPU-aaaa")], max_series=1)

    def event(xid):
        return type("E", (), {"eventType": 0x8, "eventData": xid, "device": FakeHandle(0)})()

    for xid in (79, 48, 31):
        listener.record(event(xid))
    assert listener.counts() == {("0", "79"): 1, ("0", "other"): 2}


def test_non_fatal_xid_is_counted_but_keeps_the_gpu_healthy():
    fake = FakeNvml([FakeGpu()])
    fake.push_xid(0, 13)  # graphics engine exception: usually the application's fault
    gpus = sampler(fake)
    gpus.start()
    try:
        wait_until(lambda: gpus.xid_counts() and gpus.samples)
        assert gpus.unhealthy_reasons() == ()
    finally:
        gpus.stop()


def test_uncorrected_ecc_pending_remap_and_lost_gpu_are_unhealthy():
    fake = FakeNvml([
        FakeGpu(ecc_uncorrected=2),
        FakeGpu(remapped_rows=(0, 1, 1, 0)),
        FakeGpu(errors={"nvmlDeviceGetUtilizationRates": NVML_ERROR_GPU_IS_LOST}),
    ])
    gpus = sampler(fake)
    gpus.open()
    gpus.sample()
    reasons = gpus.unhealthy_reasons()
    assert [r.split(":")[0] for r in reasons] == ["gpu 0", "gpu 1", "gpu 2"]
    assert "uncorrected ECC" in reasons[0] and "pending" in reasons[1] and "lost" in reasons[2]
    m = scrape(gpus)
    assert m["trainwarden_gpu_healthy"] == {L(gpu="0"): 0.0, L(gpu="1"): 0.0, L(gpu="2"): 0.0}
    assert m["trainwarden_gpu_read_errors_total"][L(gpu="2")] == 1.0
    assert L(gpu="2") not in m["trainwarden_gpu_utilization_ratio"]


def test_one_bad_sample_is_logged_and_the_loop_survives(caplog):
    fake = FakeNvml([FakeGpu()])
    fake.gpus[0].errors = {"nvmlDeviceGetMemoryInfo": RuntimeError("driver hiccup")}
    gpus = sampler(fake)
    gpus.start()
    try:
        wait_until(lambda: fake.calls["nvmlDeviceGetMemoryInfo"] >= 2)
        fake.gpus[0].errors = {}
        wait_until(lambda: gpus.samples)
        m = scrape(gpus)
    finally:
        gpus.stop()
    assert m["trainwarden_gpu_sample_errors_total"][L()] >= 2
    assert m["trainwarden_gpu_memory_used_bytes"] == {L(gpu="0"): 30 * 2**30}
    assert "driver hiccup" in caplog.text


@pytest.mark.parametrize(
    "fake, reason",
    [
        (FakeNvml([], init_error=NVML_ERROR_LIBRARY_NOT_FOUND), "nvml_library_not_found"),
        (FakeNvml([]), "no_gpus"),
        (FakeNvml([FakeGpu()], module_errors={"nvmlDeviceGetHandleByIndex": NVML_ERROR_GPU_IS_LOST}), "no_gpus"),
    ],
)
def test_no_nvml_or_no_gpu_gives_availability_zero(fake, reason):
    gpus = sampler(fake)
    gpus.start()
    gpus.sample()
    m = scrape(gpus)
    gpus.stop()
    assert m["trainwarden_gpu_monitoring_available"] == {L(): 0.0}
    assert m["trainwarden_gpu_monitoring_info"] == {L(reason=reason): 1.0}
    assert "trainwarden_gpu_utilization_ratio" not in m
    assert gpus.unhealthy_reasons() == ()
    assert fake.shut_down == (reason == "no_gpus")  # NVML initialised without GPUs is shut down again


def test_nvml_package_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    gpus = GpuHealthSampler(GpuHealthConfig(node="n1"))
    gpus.start()
    gpus.stop()
    assert scrape(gpus)["trainwarden_gpu_monitoring_info"] == {L(reason="nvml_not_installed"): 1.0}


def test_real_pynvml_without_a_gpu_reports_unavailable():
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this host has a working NVML; the no-GPU path is covered by the fakes")
    gpus = GpuHealthSampler(GpuHealthConfig(node="n1"))
    gpus.start()
    gpus.stop()
    assert scrape(gpus)["trainwarden_gpu_monitoring_available"] == {L(): 0.0}


@pytest.mark.parametrize(
    "kwargs", [{"interval_s": 0}, {"ecc_counter": "lifetime"}, {"max_xid_series": 0}, {"node": ""}]
)
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match="GpuHealthConfig"):
        GpuHealthConfig(**{"node": "n1", **kwargs})


def test_the_fake_answers_with_pynvmls_own_types_and_errors():
    pynvml = pytest.importorskip("pynvml")
    fake = FakeNvml([FakeGpu(errors={"nvmlDeviceGetTotalEccErrors": NVML_ERROR_NOT_SUPPORTED})])
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(fake.nvmlDeviceGetUtilizationRates(handle), pynvml.c_nvmlUtilization_t)
    assert isinstance(fake.nvmlDeviceGetMemoryInfo(handle), pynvml.c_nvmlMemory_t)
    assert isinstance(fake.nvmlDeviceGetUUID(handle), str)  # pynvml decodes (convertStrBytes)
    # a GPU without ECC (a consumer card) answers as the library does: NVMLError_NotSupported, value 3
    with pytest.raises(pynvml.NVMLError_NotSupported) as err:
        fake.nvmlDeviceGetTotalEccErrors(handle, fake.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, fake.NVML_VOLATILE_ECC)
    assert err.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_a_gpu_fault_names_the_ranks_that_run_on_that_gpu():
    from trainwarden.agent.telemetry.job_telemetry import JobTelemetry, WorkerInfo

    fake = FakeNvml([FakeGpu(uuid="GPU-aaaa"), FakeGpu(uuid="GPU-bbbb", ecc_uncorrected=2)])
    gpus = sampler(fake)
    gpus.open()
    gpus.sample()
    telemetry = JobTelemetry()
    for rank, uuid in ((0, "GPU-aaaa"), (1, "GPU-bbbb"), (2, "")):
        telemetry.connect(WorkerInfo(job="llm", rank=rank, world_size=3, pid=100 + rank, gpu_uuid=uuid))
    # rank 2 names its GPU with its first CUDA step (a later Hello)
    telemetry.update_worker("llm", 2, 102, mesh={}, step_source="", gpu_uuid="GPU-bbbb")
    assert telemetry.ranks_on_gpus(["GPU-bbbb"]) == {"GPU-bbbb": {"llm": (1, 2)}}
    assert gpus.unhealthy_reasons(telemetry.ranks_on_gpus) == (
        "gpu 1: 2 uncorrected ECC errors (volatile counter) (job llm ranks 1,2)",)
    assert gpus.unhealthy_reasons() == ("gpu 1: 2 uncorrected ECC errors (volatile counter)",)
    assert [r.gpu_uuid for r in telemetry.snapshot("llm")[0].ranks] == ["GPU-aaaa", "GPU-bbbb", "GPU-bbbb"]


def test_the_hello_carries_the_workers_gpu_to_the_agent():
    from trainwarden.agent.shared import telemetry_pb2 as pb
    from trainwarden.agent.telemetry.records import worker_info

    info = worker_info(pb.Hello(job="llm", rank=0, world_size=1, pid=7, gpu_uuid="GPU-aaaa"))
    assert info.gpu_uuid == "GPU-aaaa"

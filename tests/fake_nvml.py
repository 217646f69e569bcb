"""A stand-in for the ``pynvml`` module (nvidia-ml-py), for tests of the GPU health sampler.

It mirrors the parts of pynvml the sampler uses, with pynvml's own types where they do not need a driver:
errors are pynvml's ``NVMLError``, so ``NVMLError(code)`` is the subclass the real library raises for that
code (``NVMLError_NotSupported`` for a field a GPU lacks, ``NVMLError_GpuIsLost``, ...) with ``.value``;
utilization and memory come back as pynvml's ctypes structures (``c_nvmlUtilization_t``, ``c_nvmlMemory_t``),
strings as ``str`` (pynvml's ``convertStrBytes``), counters as ``int``, remapped rows as a 4-tuple; the
constants are pynvml's. Device handles are ``FakeHandle`` (the real ones are pointers into the driver) and
XID events are namespaces with ``c_nvmlEventData_t``'s field names. The event set's ``nvmlEventSetWait_v2``
blocks on a queue and raises ``NVMLError_Timeout`` when nothing arrives in time. Each ``FakeGpu`` holds its
readings and can make any function raise a given error code (``errors={"nvmlDeviceGetPowerUsage":
NVML_ERROR_NOT_SUPPORTED}``). ``calls`` counts calls per function name.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml

NVML_ERROR_UNINITIALIZED = pynvml.NVML_ERROR_UNINITIALIZED
NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
NVML_ERROR_DRIVER_NOT_LOADED = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
NVML_ERROR_TIMEOUT = pynvml.NVML_ERROR_TIMEOUT
NVML_ERROR_LIBRARY_NOT_FOUND = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
NVML_ERROR_FUNCTION_NOT_FOUND = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
NVML_ERROR_GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
NVML_ERROR_UNKNOWN = pynvml.NVML_ERROR_UNKNOWN

NVMLError = pynvml.NVMLError
"""pynvml's: ``NVMLError(code)`` builds the per-code subclass, as the library's return check does."""


@dataclass
class FakeGpu:
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    name: str = "NVIDIA H100 80GB HBM3"
    util_gpu: int = 87
    util_memory: int = 40
    mem_used: int = 30 * 2**30
    mem_total: int = 80 * 2**30
    temperature: int = 71
    power_mw: int = 250_000
    sm_mhz: int = 1410
    clock_reasons: int = 0x40 | 0x4  # hw_thermal_slowdown + sw_power_cap
    ecc_corrected: int = 3
    ecc_uncorrected: int = 0
    remapped_rows: tuple[int, int, int, int] = (2, 0, 0, 0)
    pcie_replays: int = 5
    errors: dict[str, object] = field(default_factory=dict)
    """function name -> NVML error code to raise, or an exception instance to raise."""


@dataclass(frozen=True)
class FakeHandle:
    index: int


class FakeNvml:
    """Use an instance where the sampler expects the ``pynvml`` module."""

    NVMLError = NVMLError
    NVML_ERROR_UNINITIALIZED = NVML_ERROR_UNINITIALIZED
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_DRIVER_NOT_LOADED = NVML_ERROR_DRIVER_NOT_LOADED
    NVML_ERROR_TIMEOUT = NVML_ERROR_TIMEOUT
    NVML_ERROR_LIBRARY_NOT_FOUND = NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_ERROR_FUNCTION_NOT_FOUND = NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_ERROR_GPU_IS_LOST = NVML_ERROR_GPU_IS_LOST
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC
    NVML_AGGREGATE_ECC = pynvml.NVML_AGGREGATE_ECC
    NVML_MEMORY_ERROR_TYPE_CORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError

    def __init__(self, gpus: list[FakeGpu], *, init_error: int | None = None, module_errors: dict | None = None):
        self.gpus = gpus
        self.init_error = init_error
        self.module_errors = dict(module_errors or {})
        self.calls: Counter[str] = Counter()
        self.events: queue.Queue = queue.Queue()
        self.registered: list[int] = []
        self.freed = False
        self.shut_down = False
        self._lock = threading.Lock()

    def push_xid(self, index: int, xid: int) -> None:
        self.events.put(SimpleNamespace(device=FakeHandle(index), eventType=pynvml.nvmlEventTypeXidCriticalError,
                                        eventData=xid, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF))

    # ---- helpers ---------------------------------------------------------------------------------
    def _enter(self, fn: str, handle: FakeHandle | None = None) -> FakeGpu | None:
        with self._lock:
            self.calls[fn] += 1
        error = self.module_errors.get(fn)
        gpu = self.gpus[handle.index] if handle is not None else None
        if gpu is not None and fn in gpu.errors:
            error = gpu.errors[fn]
        if isinstance(error, BaseException):
            raise error
        if error is not None:
            raise NVMLError(error)
        return gpu

    # ---- library ---------------------------------------------------------------------------------
    def nvmlInit(self):
        self._enter("nvmlInit")
        if self.init_error is not None:
            raise NVMLError(self.init_error)

    def nvmlShutdown(self):
        self._enter("nvmlShutdown")
        self.shut_down = True

    def nvmlDeviceGetCount(self):
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._enter("nvmlDeviceGetHandleByIndex")
        return FakeHandle(index)

    def nvmlDeviceGetIndex(self, handle):
        self._enter("nvmlDeviceGetIndex", handle)
        return handle.index

    def nvmlDeviceGetUUID(self, handle):
        return self._enter("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetName(self, handle):
        return self._enter("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetUtilizationRates(self, handle):
        gpu = self._enter("nvmlDeviceGetUtilizationRates", handle)
        return pynvml.c_nvmlUtilization_t(gpu=gpu.util_gpu, memory=gpu.util_memory)

    def nvmlDeviceGetMemoryInfo(self, handle):
        gpu = self._enter("nvmlDeviceGetMemoryInfo", handle)
        return pynvml.c_nvmlMemory_t(total=gpu.mem_total, free=gpu.mem_total - gpu.mem_used, used=gpu.mem_used)

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return self._enter("nvmlDeviceGetTemperature", handle).temperature

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._enter("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetClockInfo(self, handle, clock_type):
        return self._enter("nvmlDeviceGetClockInfo", handle).sm_mhz

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self._enter("nvmlDeviceGetCurrentClocksEventReasons", handle).clock_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return self._enter("nvmlDeviceGetCurrentClocksThrottleReasons", handle).clock_reasons

    def nvmlDeviceGetTotalEccErrors(self, handle, error_type, counter_type):
        gpu = self._enter("nvmlDeviceGetTotalEccErrors", handle)
        return gpu.ecc_uncorrected if error_type == self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else gpu.ecc_corrected

    def nvmlDeviceGetRemappedRows(self, handle):
        return self._enter("nvmlDeviceGetRemappedRows", handle).remapped_rows

    def nvmlDeviceGetPcieReplayCounter(self, handle):
        return self._enter("nvmlDeviceGetPcieReplayCounter", handle).pcie_replays

    # ---- events ----------------------------------------------------------------------------------
    def nvmlEventSetCreate(self):
        self._enter("nvmlEventSetCreate")
        return object()

    def nvmlDeviceRegisterEvents(self, handle, event_types, event_set):
        self._enter("nvmlDeviceRegisterEvents", handle)
        self.registered.append(handle.index)

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        self._enter("nvmlEventSetWait_v2")
        try:
            return self.events.get(timeout=timeout_ms / 1000.0)
        except queue.Empty:
            raise NVMLError(NVML_ERROR_TIMEOUT) from None

    def nvmlEventSetFree(self, event_set):
        self._enter("nvmlEventSetFree")
        self.freed = True


@contextlib.contextmanager
def gpu_node_exporter(node: str = "gpu-node", *, gpus=None, interval_s: float = 0.1):
    """A node agent's GPU collector (on a fake NVML: two GPUs, an uncorrected ECC error on the second and an
    XID 79 on it, unless ``gpus`` is given), host collector and agent info, served by a real exporter on
    loopback. Yields ``(exporter, gpu_sampler, host_sampler)``; the samplers run until the block ends."""
    from trainwarden.agent.health import GpuHealthConfig, GpuHealthSampler, HostHealthConfig, HostHealthSampler
    from trainwarden.agent.metrics.exporter import AgentInfoCollector, MetricsExporter, build_registry

    fake = gpus if gpus is not None else FakeNvml([FakeGpu(uuid="GPU-aaaa"),
                                                   FakeGpu(uuid="GPU-bbbb", ecc_uncorrected=1)])
    if gpus is None:
        fake.push_xid(1, 79)
    gpu = GpuHealthSampler(GpuHealthConfig(node=node, interval_s=interval_s, xid_wait_s=0.1), nvml=fake)
    host = HostHealthSampler(HostHealthConfig(node=node, interval_s=interval_s), worker_pids=lambda: [os.getpid()])
    gpu.start()
    host.start()
    try:
        with MetricsExporter(build_registry([gpu, host, AgentInfoCollector(node=node)]), port=0) as exporter:
            yield exporter, gpu, host
    finally:
        gpu.stop()
        host.stop()

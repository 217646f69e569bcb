"""GPU health from NVML: a sampler thread, an XID listener and a Prometheus collector.

Design
------
``GpuHealthSampler`` owns everything NVML for the agent. ``start()`` initialises NVML, opens a handle per
GPU, starts an ``XidListener`` (xid.py) and a ``PeriodicSampler`` thread (sampler.py) that reads every
GPU every ``interval_s`` seconds (utilization, memory, temperature, power, SM clock, clock-event/throttle
reasons, ECC counters, remapped rows, PCIe replays) into an immutable ``GpuSample`` per GPU and swaps the
tuple in atomically. ``collect()`` (a prometheus_client custom collector) only formats that state: a
scrape never calls NVML, so a wedged driver cannot stall the exposition.

NVML is a constructor parameter (the ``pynvml`` module of ``nvidia-ml-py`` by default; tests pass a fake).
Each call that a GPU or driver may not support is tolerated per metric: ``NotSupported`` or
``FunctionNotFound`` marks that metric unsupported for that GPU (logged once, never retried, the series is
left out); any other NVML error is counted in ``trainwarden_gpu_read_errors_total`` and logged when it
changes. No NVML, no driver, or no GPU gives ``trainwarden_gpu_monitoring_available 0`` plus
``trainwarden_gpu_monitoring_info{reason=...}`` and a warning in the log; nothing raises.

Labels are bounded: ``node``, ``gpu`` (index), ``reason`` (a fixed table), ``type`` and a capped ``xid``.
UUID and model name appear once per GPU in ``trainwarden_gpu_info``.

``unhealthy_reasons()`` turns the evidence into a verdict the agent can act on (cordon the node, leave it
out of the next rendezvous): a fatal XID, uncorrected ECC errors, a pending or failed row remap, or a lost
GPU. ``trainwarden_gpu_healthy`` exports the same verdict per GPU.
"""

from __future__ import annotations

import importlib
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from trainwarden.agent.health.sampler import PeriodicSampler
from trainwarden.agent.health.xid import XID_DESCRIPTIONS, XidListener

logger = logging.getLogger(__name__)

__all__ = ["CLOCK_EVENT_REASONS", "DEFAULT_FATAL_XIDS", "GpuHealthConfig", "GpuHealthSampler", "GpuSample"]

#: NVML clock-event (formerly "clocks throttle") reason bits, decoded into one 0/1 series per name.
CLOCK_EVENT_REASONS: tuple[tuple[int, str], ...] = (
    (0x001, "gpu_idle"),
    (0x002, "applications_clocks_setting"),
    (0x004, "sw_power_cap"),
    (0x008, "hw_slowdown"),
    (0x010, "sync_boost"),
    (0x020, "sw_thermal_slowdown"),
    (0x040, "hw_thermal_slowdown"),
    (0x080, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)

DEFAULT_FATAL_XIDS: frozenset[int] = frozenset(XID_DESCRIPTIONS)


@dataclass(frozen=True, kw_only=True)
class GpuHealthConfig:
    """How the GPU sampler samples and judges."""

    node: str = field(default_factory=socket.gethostname)
    """Value of the ``node`` label on every series."""
    interval_s: float = 5.0
    """Seconds between two samples of every GPU."""
    xid_wait_s: float = 1.0
    """Timeout of one ``nvmlEventSetWait_v2`` call; bounds how long ``stop()`` waits for the XID thread."""
    ecc_counter: Literal["volatile", "aggregate"] = "volatile"
    """ECC counters since the last driver load (volatile: what health decisions need) or lifetime."""
    max_xid_series: int = 64
    """Distinct (gpu, xid) series at most; later ones count under ``xid="other"``."""
    fatal_xids: frozenset[int] = DEFAULT_FATAL_XIDS
    """XIDs that make ``unhealthy_reasons()`` report the GPU."""

    def __post_init__(self) -> None:
        if not self.interval_s > 0 or not self.xid_wait_s > 0:
            raise ValueError(
                "GpuHealthConfig: interval_s and xid_wait_s must be > 0, "
                f"got {self.interval_s!r} and {self.xid_wait_s!r}"
            )
        if self.ecc_counter not in ("volatile", "aggregate"):
            raise ValueError(
                f"GpuHealthConfig: ecc_counter must be 'volatile' or 'aggregate', not {self.ecc_counter!r}"
            )
        if self.max_xid_series < 1:
            raise ValueError(f"GpuHealthConfig: max_xid_series must be >= 1, got {self.max_xid_series!r}")
        if not self.node:
            raise ValueError("GpuHealthConfig: node must be a non-empty name")


@dataclass(frozen=True, kw_only=True)
class GpuSample:
    """One GPU's readings at one moment; ``None`` where NVML could not or would not say."""

    index: int
    utilization_ratio: float | None = None
    memory_busy_ratio: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    sm_clock_hertz: float | None = None
    clock_event_reasons: int | None = None
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    remapped_correctable: int | None = None
    remapped_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    pcie_replays: int | None = None
    read_errors: int = 0
    lost: bool = False


@dataclass(eq=False)
class _Gpu:
    """Per-GPU state, written only by the thread that samples."""

    index: int
    handle: Any
    uuid: str = ""
    name: str = ""
    unsupported: set[str] = field(default_factory=set)
    read_errors: int = 0
    last_error: tuple[str, Any] | None = None
    lost: bool = False


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class GpuHealthSampler:
    """Samples every GPU through NVML on its own thread and exposes the latest state as metrics."""

    def __init__(
        self,
        config: GpuHealthConfig | None = None,
        *,
        nvml: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``nvml``: the ``pynvml`` module or a stand-in; None imports ``pynvml`` at ``start()``."""
        self.config = config or GpuHealthConfig()
        self._nvml = nvml
        self._gpus: list[_Gpu] = []
        self._samples: tuple[GpuSample, ...] = ()
        self._lock = threading.Lock()
        self._reason = "not_started"
        self._xids: XidListener | None = None
        self._sampler = PeriodicSampler("gpu-health", self.config.interval_s, self.sample, clock=clock)
        self._unsupported_codes: set[Any] = set()

    # ---- lifecycle -------------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        """True when NVML is initialised and at least one GPU has a handle."""
        return self._reason == "ok"

    @property
    def unavailable_reason(self) -> str:
        """``ok``, or why GPU monitoring is off: ``not_started``, ``nvml_not_installed``,
        ``nvml_library_not_found``, ``driver_not_loaded``, ``nvml_init_failed``, ``no_gpus``, ``stopped``."""
        return self._reason

    def open(self) -> bool:
        """Initialise NVML and open GPU handles, without threads. Returns ``available``."""
        if self._reason != "not_started":
            return self.available
        if self._nvml is None:
            try:
                self._nvml = importlib.import_module("pynvml")
            except ImportError:
                return self._unavailable("nvml_not_installed", "no pynvml module: pip install nvidia-ml-py")
        nvml = self._nvml
        self._unsupported_codes = {
            getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", 3),
            getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13),
        }
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as err:
            reason = {
                getattr(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", 12): "nvml_library_not_found",
                getattr(nvml, "NVML_ERROR_DRIVER_NOT_LOADED", 9): "driver_not_loaded",
            }.get(getattr(err, "value", None), "nvml_init_failed")
            return self._unavailable(reason, f"nvmlInit failed: {err} (is the NVIDIA driver installed and loaded?)")
        except Exception as err:  # a broken library is no reason to take the agent down
            return self._unavailable("nvml_init_failed", f"nvmlInit failed: {err!r}")
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as err:
            self._shutdown()
            return self._unavailable("nvml_init_failed", f"nvmlDeviceGetCount failed: {err}")
        for index in range(count):
            try:
                gpu = _Gpu(index=index, handle=nvml.nvmlDeviceGetHandleByIndex(index))
            except nvml.NVMLError as err:
                logger.warning("GPU %d: no NVML handle (%s); it will not be monitored", index, err)
                continue
            gpu.uuid = _text(self._call(gpu, "uuid", nvml.nvmlDeviceGetUUID, gpu.handle) or "")
            gpu.name = _text(self._call(gpu, "name", nvml.nvmlDeviceGetName, gpu.handle) or "")
            self._gpus.append(gpu)
        if not self._gpus:
            self._shutdown()
            return self._unavailable("no_gpus", f"NVML reports {count} GPUs and none could be opened")
        self._reason = "ok"
        logger.info("GPU health: monitoring %d GPUs through NVML", len(self._gpus))
        return True

    def start(self) -> None:
        """Open NVML, then start the XID listener (where supported) and the sampler thread."""
        if not self.open():
            return
        gpus = [(gpu.index, gpu.handle, gpu.uuid) for gpu in self._gpus]
        self._xids = XidListener(
            self._nvml, gpus, wait_s=self.config.xid_wait_s, max_series=self.config.max_xid_series
        )
        self._xids.start()
        self._sampler.start()

    def liveness(self) -> str | None:
        """None while the threads it started run (or none were started: no GPU). A thread stuck inside NVML is not
        reported: that is the driver's fault, a restarted agent would be stuck the same way, and the stale
        samples show it (trainwarden_gpu_*); a thread that has ended is this code's fault, and a restart cures it."""
        if not self.available:
            return None
        if not self._sampler.running:
            return "GPU sampler: its thread has ended"
        if self._xids is not None and self._xids.ended:
            return "GPU XID listener: its thread has ended"
        return None

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop and join both threads, free the event set and shut NVML down. Safe to call twice."""
        timeout_s = self.config.xid_wait_s + 5.0 if timeout_s is None else timeout_s
        sampler_stopped = self._sampler.stop(timeout_s)
        xids_stopped = self._xids.stop(timeout_s) if self._xids is not None else True
        if not self.available:
            return
        self._reason = "stopped"
        with self._lock:
            self._samples = ()  # no stale GPU series once monitoring is off
        if sampler_stopped and xids_stopped:  # never shut NVML down under a running thread
            self._shutdown()

    def _shutdown(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception as err:  # cleanup: report, never raise
            logger.warning("nvmlShutdown failed: %s", err)

    # ---- sampling --------------------------------------------------------------------------------
    def sample(self) -> None:
        """Read every GPU once and publish the result (the sampler thread calls this)."""
        if not self.available:
            return
        samples = tuple(self._read(gpu) for gpu in self._gpus)
        with self._lock:
            self._samples = samples

    @property
    def samples(self) -> tuple[GpuSample, ...]:
        """The latest sample of every monitored GPU (empty before the first one)."""
        with self._lock:
            return self._samples

    def xid_counts(self) -> dict[tuple[str, str], int]:
        """XID events since start, keyed by (gpu label, xid label)."""
        return self._xids.counts() if self._xids is not None else {}

    def _unavailable(self, reason: str, detail: str) -> bool:
        self._reason = reason
        logger.warning("GPU health monitoring unavailable (%s): %s", reason, detail)
        return False

    def _call(self, gpu: _Gpu, key: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call NVML for one metric of one GPU; None where unsupported or failing (see the module doc)."""
        if key in gpu.unsupported:
            return None
        nvml = self._nvml
        try:
            return fn(*args)
        except nvml.NVMLError as err:
            code = getattr(err, "value", None)
            if code in self._unsupported_codes:
                gpu.unsupported.add(key)
                logger.info("GPU %d: %s is not supported (%s); leaving it out", gpu.index, key, err)
                return None
            if code == getattr(nvml, "NVML_ERROR_GPU_IS_LOST", 15):
                gpu.lost = True
            gpu.read_errors += 1
            if gpu.last_error != (key, code):
                gpu.last_error = (key, code)
                logger.warning("GPU %d: reading %s failed: %s", gpu.index, key, err)
            return None

    def _read(self, gpu: _Gpu) -> GpuSample:
        nvml, h, call = self._nvml, gpu.handle, self._call
        util = call(gpu, "utilization", nvml.nvmlDeviceGetUtilizationRates, h)
        mem = call(gpu, "memory", nvml.nvmlDeviceGetMemoryInfo, h)
        temp = call(gpu, "temperature", nvml.nvmlDeviceGetTemperature, h, getattr(nvml, "NVML_TEMPERATURE_GPU", 0))
        power_mw = call(gpu, "power", nvml.nvmlDeviceGetPowerUsage, h)
        sm_mhz = call(gpu, "sm_clock", nvml.nvmlDeviceGetClockInfo, h, getattr(nvml, "NVML_CLOCK_SM", 1))
        counter = nvml.NVML_AGGREGATE_ECC if self.config.ecc_counter == "aggregate" else nvml.NVML_VOLATILE_ECC
        ecc_fn = nvml.nvmlDeviceGetTotalEccErrors
        corrected = call(gpu, "ecc_corrected", ecc_fn, h, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, counter)
        uncorrected = call(gpu, "ecc_uncorrected", ecc_fn, h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, counter)
        rows = call(gpu, "remapped_rows", nvml.nvmlDeviceGetRemappedRows, h)
        replays = call(gpu, "pcie_replays", nvml.nvmlDeviceGetPcieReplayCounter, h)
        return GpuSample(
            index=gpu.index,
            utilization_ratio=None if util is None else util.gpu / 100.0,
            memory_busy_ratio=None if util is None else util.memory / 100.0,
            memory_used_bytes=None if mem is None else int(mem.used),
            memory_total_bytes=None if mem is None else int(mem.total),
            temperature_celsius=None if temp is None else float(temp),
            power_watts=None if power_mw is None else power_mw / 1000.0,
            sm_clock_hertz=None if sm_mhz is None else sm_mhz * 1e6,
            clock_event_reasons=self._clock_event_reasons(gpu),
            ecc_corrected=corrected,
            ecc_uncorrected=uncorrected,
            remapped_correctable=None if rows is None else int(rows[0]),
            remapped_uncorrectable=None if rows is None else int(rows[1]),
            remap_pending=None if rows is None else bool(rows[2]),
            remap_failed=None if rows is None else bool(rows[3]),
            pcie_replays=replays,
            read_errors=gpu.read_errors,
            lost=gpu.lost,
        )

    def _clock_event_reasons(self, gpu: _Gpu) -> int | None:
        """The clock-event bitmask: the current call first, the deprecated throttle call on old drivers."""
        for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            fn = getattr(self._nvml, name, None)
            if fn is None or name in gpu.unsupported:
                continue
            value = self._call(gpu, name, fn, gpu.handle)
            if value is not None or name not in gpu.unsupported:
                return value
        return None

    # ---- verdict ---------------------------------------------------------------------------------
    def gpu_problems(self, sample: GpuSample) -> list[str]:
        """Why one GPU should not run training now (empty when it is fine)."""
        problems = []
        if sample.lost:
            problems.append("GPU is lost (NVML_ERROR_GPU_IS_LOST)")
        if sample.ecc_uncorrected:
            problems.append(f"{sample.ecc_uncorrected} uncorrected ECC errors ({self.config.ecc_counter} counter)")
        if sample.remap_pending:
            problems.append("row remapping pending: reset the GPU")
        if sample.remap_failed:
            problems.append("row remapping failed: replace the GPU")
        for (gpu, xid), count in sorted(self.xid_counts().items()):
            if gpu == str(sample.index) and xid.isdigit() and int(xid) in self.config.fatal_xids:
                problems.append(f"XID {xid} ({XID_DESCRIPTIONS.get(int(xid), 'fatal')}) seen {count}x")
        return problems

    def unhealthy_reasons(self, ranks_on_gpus: Callable[[list[str]], dict] | None = None) -> tuple[str, ...]:
        """One line per GPU problem on this node; empty when its GPUs are fit (or it has none).

        ``ranks_on_gpus`` (the agent's ``JobTelemetry.ranks_on_gpus``: GPU UUIDs -> {uuid: {job: ranks}}, from
        the UUIDs workers report) adds the ranks on each faulty GPU to its lines: the fault is theirs."""
        faults = [(s, p) for s in self.samples for p in self.gpu_problems(s)]
        if not faults:
            return ()
        uuids = {gpu.index: gpu.uuid for gpu in self._gpus}
        ranks: dict = {}
        if ranks_on_gpus is not None:
            try:
                ranks = ranks_on_gpus(sorted({uuids.get(s.index, "") for s, _ in faults} - {""}))
            except Exception as err:  # the verdict stands without the ranks
                logger.warning("cannot map GPU faults to ranks: %s", err)
        lines = []
        for sample, problem in faults:
            on_gpu = ranks.get(uuids.get(sample.index, ""), {})
            where = "; ".join(f"job {job} rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}"
                              for job, r in sorted(on_gpu.items()))
            lines.append(f"gpu {sample.index}: {problem}" + (f" ({where})" if where else ""))
        return tuple(lines)

    # ---- Prometheus ------------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        """Yield the latest state as metric families (a prometheus_client custom collector)."""
        node = self.config.node
        xid_up = self.available and self._xids is not None and self._xids.available
        yield _family("gauge", "monitoring_available", "1 when NVML GPU monitoring works on this node.",
                      [([node], float(self.available))])
        info = InfoMetricFamily("trainwarden_gpu_monitoring", "NVML GPU monitoring: ok or why off.", labels=["node"])
        info.add_metric([node], {"reason": self._reason})
        yield info
        yield _family("gauge", "xid_monitoring_available", "1 while XID events are listened for.",
                      [([node], float(xid_up))])
        yield _family("counter", "sample_errors", "GPU samples that failed as a whole.",
                      [([node], self._sampler.errors)])
        if (age := self._sampler.age_s()) is not None:
            yield _family("gauge", "sample_age_seconds", "Seconds since the latest GPU sample.", [([node], age)])
        if samples := self.samples:
            yield from self._gpu_families(node, samples)

    def _gpu_families(self, node: str, samples: tuple[GpuSample, ...]) -> Iterator[Metric]:
        gpu_info = InfoMetricFamily("trainwarden_gpu", "Identity of each GPU.", labels=["node", "gpu"])
        for gpu in self._gpus:
            gpu_info.add_metric([node, str(gpu.index)], {"uuid": gpu.uuid, "name": gpu.name})
        yield gpu_info
        for name, help_text, attr in _GAUGES:
            values = [([node, str(s.index)], float(v)) for s in samples if (v := getattr(s, attr)) is not None]
            yield _family("gauge", name, help_text, values, "gpu")
        reasons, rows, ecc, replays, read_errors, healthy = [], [], [], [], [], []
        for s in samples:
            gpu = [node, str(s.index)]
            if s.clock_event_reasons is not None:
                bits = s.clock_event_reasons
                reasons += [([*gpu, name], float(bool(bits & bit))) for bit, name in CLOCK_EVENT_REASONS]
            rows += [([*gpu, k], v) for k, v in (("correctable", s.remapped_correctable),
                                                 ("uncorrectable", s.remapped_uncorrectable)) if v is not None]
            ecc += [([*gpu, k], v) for k, v in (("corrected", s.ecc_corrected),
                                                ("uncorrected", s.ecc_uncorrected)) if v is not None]
            replays += [(gpu, s.pcie_replays)] if s.pcie_replays is not None else []
            read_errors.append((gpu, s.read_errors))
            healthy.append((gpu, 0.0 if self.gpu_problems(s) else 1.0))
        xids = [([node, gpu, xid], n) for (gpu, xid), n in sorted(self.xid_counts().items())]
        yield _family("gauge", "clock_event_active", "1 while NVML reports this clock-event (throttle) reason.",
                      reasons, "gpu", "reason")
        yield _family("gauge", "remapped_rows", "Rows remapped, by ECC error type.", rows, "gpu", "type")
        yield _family("counter", "ecc_errors", f"Memory ECC errors ({self.config.ecc_counter}).", ecc, "gpu", "type")
        yield _family("counter", "pcie_replays", "PCIe replays.", replays, "gpu")
        yield _family("counter", "read_errors", "NVML reads that failed (not unsupported).", read_errors, "gpu")
        yield _family("counter", "xid_errors", "XID critical errors reported by the driver.", xids, "gpu", "xid")
        yield _family("gauge", "healthy", "0 when the GPU has a fatal XID, uncorrected ECC errors, a pending or failed "
                      "row remap, or is lost.", healthy, "gpu")


_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("utilization_ratio", "Fraction of the last sample period in which a kernel ran.", "utilization_ratio"),
    ("memory_busy_ratio", "Fraction of the last sample period with device memory access.", "memory_busy_ratio"),
    ("memory_used_bytes", "Device memory in use.", "memory_used_bytes"),
    ("memory_total_bytes", "Device memory installed.", "memory_total_bytes"),
    ("temperature_celsius", "GPU core temperature.", "temperature_celsius"),
    ("power_usage_watts", "Power draw.", "power_watts"),
    ("sm_clock_hertz", "Current SM clock.", "sm_clock_hertz"),
    ("row_remap_pending", "1 when a row remap is pending (the GPU needs a reset).", "remap_pending"),
    ("row_remap_failed", "1 when a row remap failed (the GPU needs replacing).", "remap_failed"),
)


def _family(kind: Literal["gauge", "counter"], name: str, help_text: str, values: list, *labels: str) -> Metric:
    """A ``trainwarden_gpu_<name>`` family labelled (node, *labels) holding (label values, value) pairs."""
    family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
    family = family_type(f"trainwarden_gpu_{name}", help_text, labels=["node", *labels])
    for label_values, value in values:
        family.add_metric(label_values, value)
    return family

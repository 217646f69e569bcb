"""Host health through psutil: CPU, load, memory, disks, network and the agent's worker processes.

Design
------
``HostHealthSampler`` reads the host every ``interval_s`` seconds on a ``PeriodicSampler`` thread
(sampler.py) into an immutable ``HostSample`` and swaps it in; ``collect()`` formats the latest sample
at scrape time without touching the system. psutil is a constructor parameter (tests pass a fake), and
so is ``worker_pids``, a callable returning the pids of the training workers the agent supervises: the
host view then shows how many are alive and how much memory they hold.

Each reading is independent: a disk path that disappears, a platform without ``getloadavg`` or a pid that
exits mid-read drops that reading only (logged once per kind of failure), never the whole sample.

Labels are bounded. Disks are the configured ``disk_paths`` (label ``mountpoint``). Network interfaces
skip loopback and container plumbing (``exclude_interface_prefixes``), or are exactly ``interfaces`` when
that is given, and are capped at ``max_interfaces`` (sorted by name, a warning once when the cap bites).

CPU utilization is ``psutil.cpu_percent(interval=None)``: the busy share since the previous call, so the
first call (made at construction) only primes it and the value is averaged over one sample interval.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from trainwarden.agent.health.sampler import PeriodicSampler

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_EXCLUDED_INTERFACE_PREFIXES", "HostHealthConfig", "HostHealthSampler", "HostSample"]

#: Interfaces that carry no training traffic worth a series: loopback and container/VM plumbing.
DEFAULT_EXCLUDED_INTERFACE_PREFIXES: tuple[str, ...] = (
    "lo", "veth", "docker", "br-", "cali", "cni", "flannel", "virbr", "tunl", "kube-", "cilium", "vxlan",
)


@dataclass(frozen=True, kw_only=True)
class HostHealthConfig:
    """What the host sampler reads and how often."""

    node: str = field(default_factory=socket.gethostname)
    """Value of the ``node`` label on every series."""
    interval_s: float = 5.0
    """Seconds between two samples."""
    disk_paths: tuple[str, ...] = ("/",)
    """Filesystems to report (any path on them), e.g. the checkpoint directory's."""
    interfaces: tuple[str, ...] | None = None
    """Report exactly these network interfaces; None: every interface not excluded below."""
    exclude_interface_prefixes: tuple[str, ...] = DEFAULT_EXCLUDED_INTERFACE_PREFIXES
    """Interfaces whose name starts with one of these are left out (ignored when ``interfaces`` is set)."""
    max_interfaces: int = 16
    """At most this many interfaces get series."""

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"HostHealthConfig: interval_s must be > 0, got {self.interval_s!r}")
        if self.max_interfaces < 0:
            raise ValueError(f"HostHealthConfig: max_interfaces must be >= 0, got {self.max_interfaces!r}")
        if isinstance(self.disk_paths, str) or isinstance(self.interfaces, str):
            raise ValueError("HostHealthConfig: disk_paths and interfaces are tuples of strings, not one string")
        if not self.node:
            raise ValueError("HostHealthConfig: node must be a non-empty name")


@dataclass(frozen=True, kw_only=True)
class HostSample:
    """One reading of the host; ``None`` where it could not be read."""

    cpu_utilization_ratio: float | None = None
    load_average: tuple[float, float, float] | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_available_bytes: int | None = None
    disks: dict[str, tuple[int, int]] = field(default_factory=dict)
    """mountpoint label -> (used bytes, total bytes)"""
    network: dict[str, tuple[int, int]] = field(default_factory=dict)
    """interface -> (bytes received, bytes sent) since boot"""
    worker_processes: int | None = None
    worker_resident_bytes: int | None = None


class HostHealthSampler:
    """Samples the host through psutil on its own thread and exposes the latest sample as metrics."""

    def __init__(
        self,
        config: HostHealthConfig | None = None,
        *,
        psutil: Any = None,
        worker_pids: Callable[[], Iterable[int]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``psutil``: the psutil module or a stand-in (None imports psutil); ``worker_pids``: optional."""
        if psutil is None:
            import psutil as psutil_module

            psutil = psutil_module
        self.config = config or HostHealthConfig()
        self._psutil = psutil
        self._worker_pids = worker_pids
        self._sample: HostSample | None = None
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._sampler = PeriodicSampler("host-health", self.config.interval_s, self.sample, clock=clock)
        self._read("cpu", lambda: psutil.cpu_percent(interval=None))  # prime: the next call measures from here

    def start(self) -> None:
        """Start the sampler thread (first sample immediately)."""
        self._sampler.start()

    def liveness(self) -> str | None:
        """None while the sampler thread runs (a read of /proc stuck in the kernel is not reported: a restarted
        agent would be stuck the same way)."""
        return None if self._sampler.running else "host sampler: its thread has ended"

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop and join the sampler thread."""
        self._sampler.stop(timeout_s)

    @property
    def latest(self) -> HostSample | None:
        """The latest sample, or None before the first one."""
        with self._lock:
            return self._sample

    def sample(self) -> None:
        """Read the host once and publish the result (the sampler thread calls this)."""
        ps = self._psutil
        cpu = self._read("cpu", lambda: ps.cpu_percent(interval=None))
        load = self._read("load", lambda: ps.getloadavg())
        mem = self._read("memory", ps.virtual_memory)
        workers = self._read("workers", self._workers) if self._worker_pids is not None else None
        sample = HostSample(
            cpu_utilization_ratio=None if cpu is None else cpu / 100.0,
            load_average=None if load is None else tuple(float(x) for x in load),
            memory_total_bytes=None if mem is None else int(mem.total),
            memory_used_bytes=None if mem is None else int(mem.used),
            memory_available_bytes=None if mem is None else int(mem.available),
            disks=self._disks(),
            network=self._network(),
            worker_processes=None if workers is None else workers[0],
            worker_resident_bytes=None if workers is None else workers[1],
        )
        with self._lock:
            self._sample = sample

    def _read(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (OSError, AttributeError, RuntimeError, self._psutil.Error) as err:
            self._log_once(what, f"host health: cannot read {what} ({err!r}); leaving it out")
            return None

    def _log_once(self, key: str, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.warning(message)

    def _disks(self) -> dict[str, tuple[int, int]]:
        disks = {}
        for path in self.config.disk_paths:
            usage = self._read(f"disk {path}", lambda p=path: self._psutil.disk_usage(p))
            if usage is not None:
                disks[path] = (int(usage.used), int(usage.total))
        return disks

    def _network(self) -> dict[str, tuple[int, int]]:
        counters = self._read("network", lambda: self._psutil.net_io_counters(pernic=True)) or {}
        if self.config.interfaces is not None:
            names = [n for n in self.config.interfaces if n in counters]
        else:
            prefixes = self.config.exclude_interface_prefixes
            names = sorted(n for n in counters if not n.startswith(prefixes))
        if len(names) > self.config.max_interfaces:
            self._log_once(
                "interfaces",
                f"host health: {len(names)} network interfaces, reporting the first {self.config.max_interfaces} "
                f"by name; set HostHealthConfig.interfaces to choose them",
            )
            names = names[: self.config.max_interfaces]
        return {n: (int(counters[n].bytes_recv), int(counters[n].bytes_sent)) for n in names}

    def _workers(self) -> tuple[int, int]:
        """(live worker processes, their summed resident memory); pids that vanish are skipped."""
        alive, rss = 0, 0
        for pid in self._worker_pids():
            try:
                proc = self._psutil.Process(pid)
                rss += int(proc.memory_info().rss)
                alive += 1
            except self._psutil.Error:  # NoSuchProcess, ZombieProcess, AccessDenied: not a live worker we can read
                continue
        return alive, rss

    # ---- Prometheus ------------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        """Yield the latest sample as metric families (a prometheus_client custom collector)."""
        node = self.config.node
        yield _family("counter", "sample_errors", "Host samples that failed as a whole.",
                      [([node], self._sampler.errors)])
        if (age := self._sampler.age_s()) is not None:
            yield _family("gauge", "sample_age_seconds", "Seconds since the latest host sample.", [([node], age)])
        s = self.latest
        if s is None:
            return
        for name, help_text, value in (
            ("cpu_utilization_ratio", "Share of CPU time busy over the last sample interval.", s.cpu_utilization_ratio),
            ("memory_total_bytes", "Physical memory installed.", s.memory_total_bytes),
            ("memory_used_bytes", "Physical memory in use.", s.memory_used_bytes),
            ("memory_available_bytes", "Memory available to new processes without swapping.", s.memory_available_bytes),
            ("worker_processes", "Live training worker processes supervised by this agent.", s.worker_processes),
            ("worker_resident_memory_bytes", "Resident memory of the live training workers.", s.worker_resident_bytes),
        ):
            if value is not None:
                yield _family("gauge", name, help_text, [([node], float(value))])
        if s.load_average is not None:
            load = [([node, period], value) for period, value in zip(("1m", "5m", "15m"), s.load_average)]
            yield _family("gauge", "load_average", "System load average over a period.", load, "period")
        disks = [([node, path], used, total) for path, (used, total) in s.disks.items()]
        yield _family("gauge", "disk_used_bytes", "Bytes used on the filesystem.",
                      [(labels, used) for labels, used, _ in disks], "mountpoint")
        yield _family("gauge", "disk_total_bytes", "Size of the filesystem.",
                      [(labels, total) for labels, _, total in disks], "mountpoint")
        nics = [([node, nic], received, sent) for nic, (received, sent) in s.network.items()]
        yield _family("counter", "network_receive_bytes", "Bytes received by the interface.",
                      [(labels, received) for labels, received, _ in nics], "interface")
        yield _family("counter", "network_transmit_bytes", "Bytes sent by the interface.",
                      [(labels, sent) for labels, _, sent in nics], "interface")


def _family(kind: Literal["gauge", "counter"], name: str, help_text: str, values: list, *labels: str) -> Metric:
    """A ``trainwarden_host_<name>`` family labelled (node, *labels) holding (label values, value) pairs."""
    family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
    family = family_type(f"trainwarden_host_{name}", help_text, labels=["node", *labels])
    for label_values, value in values:
        family.add_metric(label_values, value)
    return family

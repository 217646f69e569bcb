"""The node agent: telemetry ingest, metrics, GPU and host health, and the watchdog, put together.

One ``NodeAgent`` per node. ``trainwarden run`` starts one in-process; ``trainwarden agent`` runs one as
a daemon. It owns, and starts and stops in order:

- ``JobTelemetry``: per-job, per-rank state fed by worker telemetry;
- ``TelemetryServer``: the gRPC server on the node's unix socket (workers find it through
  ``TRAINWARDEN_AGENT_SOCKET``);
- with ``health_port``, the ``HealthEndpoint``: the telemetry server's health service on a TCP port, for
  Kubernetes' gRPC probes (it answers NOT_SERVING from the start of the agent's stop, and stops last);
- the Prometheus exporter with every collector (jobs, GPUs, host, watchdog, incidents, the agent);
- ``GpuHealthSampler`` and ``HostHealthSampler``, each on its own thread;
- the ``Watchdog``, which acts through ``AgentActions`` (node/actions.py): diagnostics and abort commands over the
  telemetry stream, SIGKILL for workers that cannot obey (stopped, wedged), incidents to disk and etcd;
- with an etcd client, the publisher of committed checkpoints: a worker reports a commit with its path,
  the agent writes ``jobs/<job>/checkpoint`` (workers hold no etcd client or credentials).

Stopping is the reverse of starting, and every part's ``stop`` is called even if an earlier one fails.

``liveness()`` is what the daemon's systemd keep-alives rest on (agent/node/liveness.py): the gRPC server answers
its own health service through the socket, as a worker or a probe would reach it; the loops that run periodically
(watchdog, idle-job pruning) finished an iteration recently (``Heartbeat``, agent/common/heartbeat.py); the
threads of the metrics server and the health samplers still run. A sampler stuck in NVML or /proc is left out
on purpose: a restarted agent would be stuck the same way.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from trainwarden.agent import __version__
from trainwarden.agent.shared.contract import MAX_STEP_SEND_S
from trainwarden.agent.metrics.exporter import AgentInfoCollector, MetricsExporter, build_registry
from trainwarden.agent.health import GpuHealthConfig, GpuHealthSampler, HostHealthConfig, HostHealthSampler
from trainwarden.agent.incidents import IncidentCollector, IncidentStore
from trainwarden.agent.metrics.job_collector import JobMetricsCollector
from trainwarden.agent.telemetry.job_telemetry import JobTelemetry
from trainwarden.agent.common.heartbeat import Heartbeat
from trainwarden.agent.common.paths import job_state_dir, validate_job_name
from trainwarden.agent.etcd.job_records import JobRecords
from trainwarden.agent.etcd.writer import EtcdWriter
from trainwarden.agent.node.checkpoint_incidents import CheckpointIncidents
from trainwarden.agent.node.numeric_incidents import NumericIncidents
from trainwarden.agent.node.checkpoint_publisher import CheckpointPublisher
from trainwarden.agent.node.actions import AgentActions
from trainwarden.agent.node.endpoints import health_status
from trainwarden.agent.watchdog.straggler import StragglerConfig, StragglerPolicy
from trainwarden.agent.telemetry.health_endpoint import HealthEndpoint
from trainwarden.agent.telemetry.server import TelemetryServer
from trainwarden.agent.watchdog.interface import WatchdogConfig
from trainwarden.agent.watchdog.loop import Watchdog
from trainwarden.agent.watchdog.hang import HangConfig
from trainwarden.agent.watchdog.straggler_trace import TRACE_DIR_ENV

logger = logging.getLogger(__name__)

__all__ = ["AgentConfig", "NodeAgent", "watchdog_config"]

_PRUNE_INTERVAL_S = 60.0

@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """How one node agent runs."""

    socket_path: Path
    """Unix socket of the telemetry server."""
    node: str = field(default_factory=socket.gethostname)
    """This node's name (a metric label and the incidents' node)."""
    metrics_host: str = "127.0.0.1"
    """Address the Prometheus endpoint binds."""
    metrics_port: int | None = 9478
    """Port of the Prometheus endpoint; 0 picks a free one; None serves no metrics."""
    health_host: str = "127.0.0.1"
    """Address the gRPC health check binds (with ``health_port``)."""
    health_port: int | None = None
    """TCP port of the standard gRPC health check alone, for probes that cannot reach the unix socket
    (Kubernetes' ``grpc`` probes); 0 picks a free one; None, the default, serves none."""
    state_home: Path | None = None
    """Root of job state directories (incidents, diagnostics)."""
    records_home: Path | None = None
    """Where this agent records incidents and diagnostics about a job: ``<records_home>/<job>/``, directories of its
    own outside the job's state directory (the node daemon, root: ``<state home>/daemon/records``); None: the job's
    state directory (a launcher, which runs as the job's user)."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """Hang and straggler policy."""
    gpu_health: bool = True
    """Sample NVML (reports 'unavailable' cleanly where there is no GPU)."""
    host_disk_paths: tuple[str, ...] = ("/",)
    """Filesystems whose usage is exported."""
    allow_unverified_streams: bool = False
    """Accept telemetry streams without peer credentials (never signalled; agent/telemetry/server.py); by default
    a Hello without a token from ``<socket>.cred`` is refused."""
    telemetry_hello_timeout_s: float = 5.0
    """Seconds a new telemetry stream may stay silent before its Hello; then it is closed
    (agent/telemetry/admission.py)."""
    telemetry_max_streams_per_uid: int = 64
    """Telemetry streams one uid may hold at once (streams without a peer token count as one more uid)."""

    def __post_init__(self) -> None:
        if len(str(self.socket_path)) > 102:  # the peer-credential socket beside it adds ".cred"
            raise ValueError(f"socket path {self.socket_path} is too long: a unix socket path may have 107 bytes "
                             "and the agent adds '.cred' for a second one; choose a shorter --socket")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics port {self.metrics_port} is not a TCP port")
        if self.health_port is not None and not 0 <= self.health_port <= 65535:
            raise ValueError(f"health port {self.health_port} is not a TCP port")
        if not self.telemetry_hello_timeout_s > 0:
            raise ValueError(f"telemetry_hello_timeout_s must be positive, got {self.telemetry_hello_timeout_s}")
        if self.telemetry_max_streams_per_uid < 1:
            raise ValueError("telemetry_max_streams_per_uid must be at least 1, got "
                             f"{self.telemetry_max_streams_per_uid}")


QUIET_READ_PERIOD_ENV = "TRAINWARDEN_QUIET_READ_PERIOD_S"
"""The Flight Recorder read period the agent asks its workers for while no detector is near a decision
(`WatchdogConfig.quiet_read_period_s`; 0: never ask)."""
QUIET_STEP_SEND_ENV = "TRAINWARDEN_QUIET_STEP_SEND_S"
"""How long the agent lets its workers hold back steps that keep ending, at the same quiet times
(`WatchdogConfig.quiet_step_send_s`, 2 s by default; 0: never ask; nothing is asked while read pacing is off)."""


def _seconds_env(name: str, default: float, high: float, zero_means: str) -> float:
    value = os.environ.get(name, "").strip()
    try:
        seconds = float(value) if value else default
        if not 0 <= seconds <= high:
            raise ValueError
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected seconds between 0 ({zero_means}) and {high:g}") from None
    return seconds


def watchdog_config(straggler_policy: str = "alert", hang_floor_s: float | None = None) -> WatchdogConfig:
    """The watchdog's configuration for a straggler policy name (``alert`` or ``exclude``) and, when given, the
    hang deadline's floor in seconds (``--hang-floor``; default ``HangConfig.floor_s``), already checked where it
    was given (its declaration: agent/common/launch_options.py)."""
    try:
        policy = StragglerPolicy(straggler_policy)
    except ValueError:
        raise ValueError(f"unknown straggler policy {straggler_policy!r}; use one of "
                         f"{', '.join(p.value for p in StragglerPolicy)}") from None
    trace = os.environ.get(TRACE_DIR_ENV)
    quiet = _seconds_env(QUIET_READ_PERIOD_ENV, WatchdogConfig.quiet_read_period_s, 30,
                         "never ask the workers to read their Flight Recorders slowly")
    send = _seconds_env(QUIET_STEP_SEND_ENV, WatchdogConfig.quiet_step_send_s, MAX_STEP_SEND_S,
                        "never ask the workers to hold their steps back")
    hang = HangConfig() if hang_floor_s is None else HangConfig(floor_s=hang_floor_s)
    return WatchdogConfig(straggler=StragglerConfig(policy=policy), straggler_trace_dir=Path(trace) if trace else None,
                          quiet_read_period_s=quiet, quiet_step_send_s=send, hang=hang)


class NodeAgent:
    def __init__(self, config: AgentConfig, *, etcd: EtcdWriter | None = None, cluster=None) -> None:
        """``etcd``: the node's queued etcd writes (incident copies, exclusion requests, checkpoint pointers);
        None keeps everything on local disk. ``cluster``: the watchdog's ``HangCoordinator`` for a job of
        several nodes (agent/etcd/cluster.py)."""
        self.config = config
        records = config.records_home
        state_dir = ((lambda job: Path(records) / validate_job_name(job)) if records is not None  # noqa: E731
                     else (lambda job: job_state_dir(job, config.state_home)))
        # committed checkpoints are published to etcd from one thread of their own, never from the telemetry
        # reader that heard of them
        self.etcd = etcd
        self.publisher = CheckpointPublisher(JobRecords(None, writer=etcd)) if etcd is not None else None
        self.job_telemetry = JobTelemetry(listeners=[self.publisher] if self.publisher else [])
        self.server = TelemetryServer(config.socket_path, self.job_telemetry, node=config.node,
                                      allow_unverified=config.allow_unverified_streams,
                                      hello_timeout_s=config.telemetry_hello_timeout_s,
                                      max_streams_per_uid=config.telemetry_max_streams_per_uid)
        if etcd is not None:  # a restore asks what etcd says the job committed before it may start over
            self.server.checkpoint_record = JobRecords(etcd.client).get_checkpoint
        self.incident_counts = IncidentCollector(
            node=config.node, jobs=lambda: [job.job for job in self.job_telemetry.snapshot()])
        self.incidents = IncidentStore(state_dir=state_dir, etcd=etcd, collector=self.incident_counts,
                                       readable=records is not None)
        self.job_telemetry.add_listener(CheckpointIncidents(self.incidents.record, node=config.node))
        self.job_telemetry.add_listener(NumericIncidents(self.incidents.record, node=config.node))
        self.actions = AgentActions(self.server, self.job_telemetry, self.incidents, node=config.node)
        self.server.stream_guard = self.actions.stream_refusal  # a launcher's job: only its processes stream for it
        self.watchdog = Watchdog(self.job_telemetry, self.actions, node=config.node, config=config.watchdog,
                                 diagnostics_dir=lambda job: state_dir(job) / "diagnostics", cluster=cluster)
        self.gpus = GpuHealthSampler(GpuHealthConfig(node=config.node)) if config.gpu_health else None
        self.host = HostHealthSampler(HostHealthConfig(node=config.node, disk_paths=config.host_disk_paths),
                                      worker_pids=self._worker_pids)
        collectors = [AgentInfoCollector(node=config.node, version=__version__),
                      JobMetricsCollector(self.job_telemetry, node=config.node), self.host,
                      self.watchdog.collector(), self.incident_counts, self.actions]
        if self.gpus is not None:
            collectors.append(self.gpus)
        if etcd is not None:
            collectors.append(etcd)
        self.registry = build_registry(collectors)
        self.exporter = (MetricsExporter(self.registry, host=config.metrics_host, port=config.metrics_port)
                         if config.metrics_port is not None else None)
        self.health_endpoint = (HealthEndpoint(config.health_host, config.health_port)
                                if config.health_port is not None else None)
        self._stops: list[Callable[[], object]] = []
        self._pruner = threading.Event()
        self._pruner_thread: threading.Thread | None = None
        # pruning takes the telemetry's lock and nothing else: three missed rounds mean that lock is held for good
        self._pruned = Heartbeat("idle-job pruning", stall_s=3 * _PRUNE_INTERVAL_S)

    @property
    def metrics_url(self) -> str | None:
        return self.exporter.url if self.exporter is not None else None

    @property
    def health_url(self) -> str | None:
        """``grpc://host:port`` of the TCP health check, or None when it is off."""
        return f"grpc://{self.health_endpoint.address}" if self.health_endpoint is not None else None

    def start(self) -> "NodeAgent":
        try:
            self.server.start()
            self._stops.append(lambda: self.server.stop(1.0))
            if self.health_endpoint is not None:  # it answers from the server's health state: started after it
                self.health_endpoint.start(self.server.health)
                self._stops.insert(0, self.health_endpoint.stop)  # and stopped last
            if self.exporter is not None:
                self.exporter.start()
                self._stops.append(self.exporter.stop)
            if self.gpus is not None:
                self.gpus.start()
                self._stops.append(self.gpus.stop)
            self.host.start()
            self._stops.append(self.host.stop)
            self.watchdog.start()
            self._stops.append(lambda: self.watchdog.stop(5.0))
            self._pruned.beat()
            self._pruner_thread = threading.Thread(target=self._prune_loop, name="trainwarden-prune", daemon=True)
            self._pruner_thread.start()
            self._stops.append(self._pruner.set)
        except BaseException:
            self.stop()
            raise
        logger.info("agent on %s: telemetry %s, metrics %s, health check %s", self.config.node, self.server.address,
                    self.metrics_url or "off", self.health_url or "off")
        return self

    def stop(self) -> None:
        if self._stops and self.server.health is not None:
            self.server.health.enter_graceful_shutdown()  # probes see NOT_SERVING while the parts stop
        while self._stops:
            stop = self._stops.pop()
            try:
                stop()
            except Exception:
                logger.exception("error while stopping the agent; continuing")

    def liveness(self, *, timeout: float = 5.0) -> str | None:
        """None while every part works (module docstring); else each part that does not, in one line.
        ``timeout``: for the health call through the socket."""
        status = health_status(self.config.socket_path, timeout=timeout)
        problems = [] if status == "SERVING" else [f"telemetry server: its health check answers {status}"]
        if self.exporter is not None and not self.exporter.serving:
            problems.append("metrics server: its thread has ended")
        pruner = self._pruner_thread
        problems += [self.watchdog.liveness(), self._pruned.problem(running=pruner is not None and pruner.is_alive()),
                     self.host.liveness(), self.gpus.liveness() if self.gpus is not None else None]
        return "; ".join(p for p in problems if p) or None

    def _worker_pids(self) -> list[int]:
        return [r.pid for job in self.job_telemetry.snapshot() for r in job.ranks if r.connected and r.pid > 0]

    def _prune_loop(self) -> None:
        while not self._pruner.wait(_PRUNE_INTERVAL_S):
            try:
                self.job_telemetry.prune(600.0)
            except Exception:
                logger.exception("pruning idle jobs failed")
            self._pruned.beat()

    def __enter__(self) -> "NodeAgent":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

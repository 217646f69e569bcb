"""`trainwarden agent`: the node daemon (systemd unit, Kubernetes DaemonSet).

It runs one ``NodeAgent`` (agent/node/agent.py: telemetry socket, Prometheus endpoint, health samplers,
watchdog) until SIGTERM or SIGINT, then stops it (the socket file is removed) and exits 0. Jobs on the
node find it through ``TRAINWARDEN_AGENT_SOCKET`` (default ``/run/trainwarden/agent.sock``). With ``--etcd``,
incidents are also written to etcd, and (unless ``--no-jobs``) the ``JobRunner`` (agent/node/job_runner.py)
registers the node and runs this node's part of every submitted job that targets it. Those jobs outlive the
daemon: stopping it (or killing it) leaves them running, and the next daemon adopts them.

Start-up problems are one line on stderr and a named exit code: a socket or port (metrics, health) that cannot
be bound, a socket directory it may not create, bad flags -> ``EXIT_USAGE`` (a restart will not fix them);
etcd not reachable -> ``EXIT_ETCD_UNAVAILABLE``. ``--check`` asks a running agent's gRPC health service on
its socket instead of starting one: exit 0 when it serves, ``EXIT_AGENT_UNAVAILABLE`` otherwise. Where the
socket cannot be reached (Kubernetes' own gRPC probes dial a TCP port) ``--health-port`` serves the same
health service, and only it, on TCP (agent/telemetry/health_endpoint.py).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from trainwarden.agent.common import exit_codes
from trainwarden.agent.common.signals import ExternalStop, StopOnSignals
from trainwarden.agent.etcd.client import EtcdConfig, EtcdSecurity
from trainwarden.agent.etcd.writer import EtcdWriter
from trainwarden.agent.node.agent import AgentConfig, NodeAgent
from trainwarden.agent.node.endpoints import check_agent

logger = logging.getLogger(__name__)

__all__ = ["DaemonOptions", "check", "run_daemon"]


@dataclass(frozen=True, kw_only=True)
class DaemonOptions:
    """What `trainwarden agent` was asked to do, beyond the agent's own configuration."""

    agent: AgentConfig
    """The node agent's configuration (socket, metrics address, node name, state home)."""
    etcd: str | None = None
    """``[http[s]://]host:port`` of the cluster's etcd, for incidents; None: incidents stay on local disk."""
    etcd_security: EtcdSecurity = field(default_factory=EtcdSecurity)
    """TLS and auth for ``etcd``."""
    run_jobs: bool = True
    """With ``etcd``: start the submitted jobs that target this node."""
    local_addr: str | None = None
    """The address this node's jobs advertise (None: their launcher picks the one that routes to etcd)."""

    def __post_init__(self) -> None:
        if self.etcd is None:
            if self.etcd_security.given:
                raise ValueError("--etcd-ca/--etcd-cert/--etcd-key/--etcd-user/--etcd-password-file apply to the "
                                 "etcd named with --etcd; give --etcd too")
            return
        if not self.etcd.rstrip("/").rpartition(":")[2].isdigit():
            raise ValueError(f"--etcd {self.etcd!r}: expected HOST:PORT, e.g. 10.0.0.5:2379")
        members = tuple(e.strip() for e in self.etcd.split(",") if e.strip())
        object.__setattr__(self, "_config", self.etcd_security.config(members))  # ValueError names the flag

    @property
    def etcd_config(self) -> EtcdConfig | None:
        return getattr(self, "_config", None)


def _connect_etcd(config: EtcdConfig):
    from trainwarden.agent.etcd.job_records import connect

    return connect(config)


def _job_runner(options: DaemonOptions, client, agent: NodeAgent):
    from trainwarden.agent.common.paths import default_state_home
    from trainwarden.agent.node.job_runner import JobRunner

    sec = options.etcd_security
    flags = {"--etcd-ca": sec.ca_cert, "--etcd-cert": sec.cert_cert, "--etcd-key": sec.cert_key,
             "--etcd-user": sec.user, "--etcd-password-file": sec.password_file}
    etcd_args = [part for flag, value in flags.items() if value for part in (flag, value)]
    config = options.agent
    gpus = agent.gpus
    return JobRunner(client, node=config.node, etcd=options.etcd, etcd_args=etcd_args,
                     state_home=config.state_home or default_state_home(), local_addr=options.local_addr,
                     endpoints={"socket": str(config.socket_path), "metrics": agent.metrics_url or ""},
                     gpus=(lambda: len(gpus.samples)) if gpus is not None else None,
                     health=gpus.unhealthy_reasons if gpus is not None else None, record=agent.incidents.record)


def run_daemon(options: DaemonOptions, *, err: TextIO | None = None, stop: threading.Event | None = None) -> int:
    """Serve until SIGTERM/SIGINT (or `stop` is set, for callers on other threads); returns an exit code."""
    from trainwarden.agent.metrics.exporter import ExporterError
    from trainwarden.agent.etcd.job_records import EtcdAccessDenied, EtcdUnavailable
    from trainwarden.agent.telemetry.health_endpoint import HealthEndpointError
    from trainwarden.agent.telemetry.server import TelemetryServerError

    err = err or sys.stderr
    config = options.agent
    client, writer = None, None
    if options.etcd:
        try:
            client = _connect_etcd(options.etcd_config)
        except ValueError as exc:
            err.write(f"trainwarden agent: {exc}\n")
            return exit_codes.EXIT_USAGE
        except EtcdAccessDenied as exc:
            err.write(f"trainwarden agent: {exc}\n")
            return exit_codes.EXIT_ETCD_UNAVAILABLE
        except EtcdUnavailable as exc:
            cause = type(exc.__cause__).__name__ if exc.__cause__ else "no answer"
            err.write(f"trainwarden agent: cannot reach etcd at {options.etcd} ({cause}); start it, or leave out "
                      "--etcd to keep incidents on local disk only\n")
            return exit_codes.EXIT_ETCD_UNAVAILABLE
    try:
        with StopOnSignals() if stop is None else ExternalStop(stop) as signals:
            writer = EtcdWriter(client, endpoint=options.etcd, node=config.node) if client is not None else None
            agent = NodeAgent(config, etcd=writer)
            try:
                agent.start()
            except (ExporterError, HealthEndpointError, TelemetryServerError, ValueError) as exc:
                err.write(f"trainwarden agent: cannot start: {exc}\n")
                return exit_codes.EXIT_USAGE
            except OSError as exc:  # the socket's directory cannot be created (permissions, read-only fs)
                err.write(f"trainwarden agent: cannot create the socket {config.socket_path}: "
                          f"{exc.strerror or exc}{f' ({exc.filename})' if exc.filename else ''}; run as a user "
                          "who may write there (systemd: RuntimeDirectory=trainwarden) or pass another --socket\n")
                return exit_codes.EXIT_USAGE
            runner = None
            try:
                if client is not None and options.run_jobs:
                    runner = _job_runner(options, client, agent)
                    runner.start()
                    agent.registry.register(runner)  # trainwarden_node_cordoned, trainwarden_node_jobs
                logger.info("trainwarden agent %s serving: socket unix:%s, metrics %s, health check %s%s%s",
                            config.node, config.socket_path, agent.metrics_url or "off", agent.health_url or "off",
                            f", incidents to etcd {options.etcd}" if options.etcd else "",
                            f", running the jobs submitted for node {config.node}" if runner else "")
                while not signals.event.wait(1.0):  # a timed wait: signal handlers run between waits
                    pass
                name = signal.Signals(signals.received).name if signals.received else "stop requested"
                logger.info("trainwarden agent: %s; stopping", name)
            finally:
                if runner is not None:
                    running = runner.stop()
                    if running:
                        logger.info("jobs %s keep running on this node; the next `trainwarden agent` adopts them "
                                    "(`trainwarden stop JOB` stops one)", ", ".join(running))
                agent.stop()
    finally:
        if writer is not None:
            writer.stop(5.0)
        if client is not None:
            client.close()
    return exit_codes.EXIT_OK


def check(socket_path: Path, *, out: TextIO | None = None, err: TextIO | None = None, timeout: float = 3.0) -> int:
    """`trainwarden agent --check`: is an agent serving on `socket_path`? (Readiness and liveness probes.)"""
    out, err = out or sys.stdout, err or sys.stderr
    problem = check_agent(socket_path, timeout=timeout)
    if problem is not None:
        err.write(f"trainwarden: {problem}\n")
        return exit_codes.EXIT_AGENT_UNAVAILABLE
    out.write(f"agent serving on unix:{socket_path}\n")
    return exit_codes.EXIT_OK

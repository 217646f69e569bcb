"""`trainwarden agent`: the node daemon (systemd unit, Kubernetes DaemonSet).

It runs one ``NodeAgent`` (agent/node/agent.py: telemetry socket, Prometheus endpoint, health samplers,
watchdog) until SIGTERM or SIGINT, then stops it (the socket file is removed) and exits 0. Jobs on the
node find it through ``TRAINWARDEN_AGENT_SOCKET`` (default ``/run/trainwarden/agent.sock``). With ``--etcd``,
incidents are also written to etcd, and (unless ``--no-jobs``) the ``JobRunner`` (agent/node/job_runner.py)
registers the node and runs this node's part of every submitted job that targets it; the daemon's metrics
endpoint relays each of those jobs' own series (agent/metrics/relay.py). Those jobs outlive the daemon: stopping
it (or killing it) leaves them running, and the next daemon adopts them. With ``--webhook-listen`` it also
serves Alertmanager's webhook, through which alerts resume failed jobs (agent/node/webhook.py).

Under systemd (``Type=notify``, deploy/systemd/trainwarden-agent.service) the daemon says ``READY=1`` once the
agent answers its own health check through the socket, sends ``WATCHDOG=1`` keep-alives while every part works
and ``STOPPING=1`` when it stops (agent/node/liveness.py); it takes systemd's variables out of its environment so
that the jobs it starts do not inherit them, and turns faulthandler on, so the SIGABRT of a missed keep-alive
leaves every thread's stack in the journal.

Start-up problems are one line on stderr and a named exit code: a socket or port (metrics, health) that cannot
be bound, a socket directory it may not create, bad flags -> ``EXIT_USAGE`` (a restart will not fix them);
etcd not reachable -> ``EXIT_ETCD_UNAVAILABLE``. ``--check`` asks a running agent's gRPC health service on
its socket instead of starting one: exit 0 when it serves, ``EXIT_AGENT_UNAVAILABLE`` otherwise. Where the
socket cannot be reached (Kubernetes' own gRPC probes dial a TCP port) ``--health-port`` serves the same
health service, and only it, on TCP (agent/telemetry/health_endpoint.py).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import signal
import ssl
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from trainwarden.agent.common import exit_codes
from trainwarden.agent.common.sdnotify import SdNotifier
from trainwarden.agent.common.signals import ExternalStop, StopOnSignals
from trainwarden.agent.etcd.client import EtcdConfig, EtcdSecurity
from trainwarden.agent.etcd.writer import EtcdWriter
from trainwarden.agent.node.agent import AgentConfig, NodeAgent
from trainwarden.agent.node.endpoints import AGENT_METRICS_RECORD, check_agent
from trainwarden.agent.node.job_etcd_identity import EtcdAdmin
from trainwarden.agent.node.job_user import PRIVILEGED_GROUPS
from trainwarden.agent.node.liveness import KeepAlive
from trainwarden.agent.node.webhook import WebhookConfig

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
    webhook: WebhookConfig | None = None
    """Serve Alertmanager's webhook: alerts resume failed jobs (agent/node/webhook.py); needs ``etcd``."""
    job_user: str | None = None
    """Who a submitted job whose spec names no ``user`` runs as (agent/node/job_user.py)."""
    allow_root_jobs: bool = False
    """Whether a submitted job may run as root (its ``user``, or ``job_user``)."""
    job_users: tuple[str, ...] = ()
    """With ``job_groups``: who may run submitted jobs here (empty, both: anyone but root and the privileged)."""
    job_groups: tuple[str, ...] = ()
    """Groups whose members may run submitted jobs here."""
    privileged_groups: tuple[str, ...] = PRIVILEGED_GROUPS
    """A member of these runs no job here unless ``job_users`` names it (agent/node/job_user.py)."""
    etcd_admin: "EtcdAdmin | None" = None
    """An etcd user with the root role: each launcher then gets an etcd user of its own, confined to its job
    (agent/node/job_etcd_identity.py), instead of the daemon's credential."""

    def __post_init__(self) -> None:
        if self.webhook is not None and self.etcd is None:
            raise ValueError("--webhook-listen resumes jobs kept in etcd: give --etcd too")
        if self.etcd_admin is not None and self.etcd is None:
            raise ValueError("--etcd-admin-user makes the launchers' users in the etcd of --etcd: give --etcd too")
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


def _job_runner(options: DaemonOptions, client, agent: NodeAgent, admin=None):
    from trainwarden.agent.common.paths import default_state_home
    from trainwarden.agent.node.job_etcd_identity import JobEtcdIdentities, shared_credential_note
    from trainwarden.agent.node.job_runner import JobRunner

    sec = options.etcd_security
    flags = {"--etcd-ca": sec.ca_cert, "--etcd-cert": sec.cert_cert, "--etcd-key": sec.cert_key,
             "--etcd-user": sec.user, "--etcd-password-file": sec.password_file}
    if admin is not None:  # each launcher gets a user of its own, and the CA only of the daemon's files
        flags = {"--etcd-ca": sec.ca_cert}
    etcd_args = [part for flag, value in flags.items() if value for part in (flag, value)]
    if sec.insecure:  # the operator's choice for this node holds for the launchers it starts
        etcd_args.append("--insecure-etcd")
    config = options.agent
    home = config.state_home or default_state_home()
    identities = None
    if admin is not None:
        identities = JobEtcdIdentities(admin, node=config.node, state_home=home, launcher_args=etcd_args)
    else:
        logger.warning(shared_credential_note(etcd_args))
    gpus = agent.gpus
    return JobRunner(client, node=config.node, etcd=options.etcd, etcd_args=etcd_args,
                     state_home=home, local_addr=options.local_addr, identities=identities,
                     endpoints={"socket": str(config.socket_path), "metrics": agent.metrics_url or ""},
                     gpus=(lambda: len(gpus.samples)) if gpus is not None else None,
                     health=(lambda: gpus.unhealthy_reasons(agent.job_telemetry.ranks_on_gpus))
                     if gpus is not None else None, record=agent.incidents.record,
                     default_user=options.job_user, allow_root_jobs=options.allow_root_jobs, lineage=agent.actions,
                     job_users={"users": options.job_users, "groups": options.job_groups,
                                "privileged_groups": options.privileged_groups},
                     etcd_files=tuple(path for flag, path in flags.items() if path and flag != "--etcd-user"))


def _relay(runner, config: AgentConfig):
    """The series of the jobs this daemon runs, relayed from their launchers (agent/metrics/relay.py)."""
    from trainwarden.agent.common.paths import default_state_home, job_state_dir
    from trainwarden.agent.metrics.launcher_fetch import TargetRefused, read_record
    from trainwarden.agent.metrics.relay import LauncherRelay

    home = config.state_home or default_state_home()

    def target(job: str) -> "str | TargetRefused":
        try:  # a file of the job's user: no link followed, no FIFO blocked on (agent/metrics/launcher_fetch.py)
            return read_record(job_state_dir(job, home), AGENT_METRICS_RECORD) or ""
        except TargetRefused as exc:
            return exc

    def targets() -> dict[str, "str | TargetRefused"]:
        return {job: target(job) for job in runner.launchers()}

    return LauncherRelay(targets, node=config.node)


def _webhook(options: DaemonOptions, client, agent: NodeAgent):
    from trainwarden.agent.etcd.jobs import JobControl
    from trainwarden.agent.node.webhook import AlertmanagerWebhook, AlertResumer

    resumer = AlertResumer(JobControl(client), node=options.agent.node,
                           resumes_per_hour=options.webhook.resumes_per_hour, record=agent.incidents.record)
    return AlertmanagerWebhook(options.webhook, resumer)


def run_daemon(options: DaemonOptions, *, err: TextIO | None = None, stop: threading.Event | None = None,
               notifier: SdNotifier | None = None) -> int:
    """Serve until SIGTERM/SIGINT (or `stop` is set, for callers on other threads); returns an exit code.
    ``notifier``: where readiness and keep-alives go (default: systemd's, from the environment)."""
    from trainwarden.agent.metrics.exporter import ExporterError
    from trainwarden.agent.telemetry.health_endpoint import HealthEndpointError
    from trainwarden.agent.telemetry.server import TelemetryServerError

    err = err or sys.stderr
    if notifier is None:
        notifier = SdNotifier.from_environment(os.environ, unset=True)
    if notifier.watchdog_s and not faulthandler.is_enabled():
        try:
            faulthandler.enable()
        except (AttributeError, ValueError, OSError):  # a stderr without a file descriptor
            pass
    config = options.agent
    if config.records_home is None:  # root's records about jobs stay out of the trees their users own (issue 44)
        from trainwarden.agent.common.paths import records_home

        config = dataclasses.replace(config, records_home=records_home(config.state_home))
    client, writer, admin = None, None, None
    try:
        client, admin = _open_etcd(options)
        with StopOnSignals() if stop is None else ExternalStop(stop) as signals:
            writer = EtcdWriter(client, endpoint=options.etcd, node=config.node) if client is not None else None
            agent = NodeAgent(config, etcd=writer)
            try:
                agent.start()
            except (ExporterError, HealthEndpointError, TelemetryServerError, ValueError) as exc:
                raise _Refused(exit_codes.EXIT_USAGE, f"cannot start: {exc}") from None
            except OSError as exc:  # the socket's directory cannot be created (permissions, read-only fs)
                raise _Refused(exit_codes.EXIT_USAGE,
                               f"cannot create the socket {config.socket_path}: {exc.strerror or exc}"
                               f"{f' ({exc.filename})' if exc.filename else ''}; run as a user who may write there "
                               "(systemd: RuntimeDirectory=trainwarden) or pass another --socket") from None
            try:
                _serve(options, config, client, admin, agent, signals, notifier)
            finally:
                agent.stop()
    except _Refused as refused:
        err.write(f"trainwarden agent: {refused.message}\n")
        return refused.code
    finally:
        if writer is not None:
            writer.stop(5.0)
        if client is not None:
            client.close()
        if admin is not None:
            admin.close()
    return exit_codes.EXIT_OK


class _Refused(Exception):
    """The daemon cannot serve: it exits with ``code`` after saying ``message``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def _open_etcd(options: DaemonOptions):
    """The daemon's etcd client and, when it runs jobs with an admin credential, the admin's; (None, None) without
    ``--etcd``. ``_Refused`` saying what to do when etcd cannot be used."""
    from trainwarden.agent.etcd.job_records import EtcdAccessDenied, EtcdUnavailable

    if not options.etcd:
        return None, None
    client = None
    try:
        client = _connect_etcd(options.etcd_config)
        admin = None
        if options.etcd_admin is not None and options.run_jobs:
            from trainwarden.agent.node.job_etcd_identity import open_admin

            admin = open_admin(options.etcd_admin, options.etcd_config)
        return client, admin
    except ValueError as exc:
        if client is not None:
            client.close()
        raise _Refused(exit_codes.EXIT_USAGE, str(exc)) from None
    except EtcdAccessDenied as exc:
        if client is not None:
            client.close()
        raise _Refused(exit_codes.EXIT_ETCD_UNAVAILABLE, str(exc)) from None
    except EtcdUnavailable as exc:
        if client is not None:
            client.close()
        cause = type(exc.__cause__).__name__ if exc.__cause__ else "no answer"
        raise _Refused(exit_codes.EXIT_ETCD_UNAVAILABLE,
                       f"cannot reach etcd at {options.etcd} ({cause}); start it, or leave out --etcd to keep "
                       "incidents on local disk only") from None


def _serve(options: DaemonOptions, config: AgentConfig, client, admin, agent: NodeAgent, signals,
           notifier: SdNotifier) -> None:
    """With the agent started: this node's job runner and the webhook, then keep-alives until a signal; what it
    started is stopped on the way out (the jobs keep running, for the next daemon to adopt)."""
    runner, webhook = None, None
    try:
        if client is not None and options.run_jobs:
            runner = _job_runner(options, client, agent, admin)
            runner.start()
            agent.registry.register(runner)  # trainwarden_node_cordoned, trainwarden_node_jobs
            agent.registry.register(_relay(runner, config))  # each running job's own series
        if options.webhook is not None:
            webhook = _webhook(options, client, agent)
            try:
                webhook.start()
            except (OSError, ssl.SSLError) as exc:
                raise _Refused(exit_codes.EXIT_USAGE,
                               f"cannot serve the webhook on {options.webhook.listen}: "
                               f"{getattr(exc, 'strerror', None) or exc}; pick another --webhook-listen (or fix "
                               "the TLS files)") from None
            agent.registry.register(webhook)  # trainwarden_webhook_decisions_total, _requests_total
        serving = (f"socket unix:{config.socket_path}, metrics {agent.metrics_url or 'off'}, "
                   f"health check {agent.health_url or 'off'}"
                   f"{f', incidents to etcd {options.etcd}' if options.etcd else ''}"
                   f"{f', running the jobs submitted for node {config.node}' if runner else ''}"
                   f"{f', Alertmanager webhook {webhook.url}' if webhook else ''}")
        logger.info("trainwarden agent %s serving: %s", config.node, serving)
        keepalive = _keepalive(notifier, agent, runner, webhook, status=f"serving: {serving}")
        keepalive.tick()
        while not signals.event.wait(keepalive.wait_s(1.0)):  # timed: signal handlers run between waits
            keepalive.tick()
        name = signal.Signals(signals.received).name if signals.received else "stop requested"
        logger.info("trainwarden agent: %s; stopping", name)
        keepalive.stopping(name)
    finally:
        if webhook is not None:
            webhook.stop()
        if runner is not None:
            running = runner.stop()
            if running:
                logger.info("jobs %s keep running on this node; the next `trainwarden agent` adopts them "
                            "(`trainwarden stop JOB` stops one)", ", ".join(running))


def _keepalive(notifier: SdNotifier, agent: NodeAgent, runner, webhook=None, *, status: str) -> KeepAlive:
    """Readiness and keep-alives from the agent's, the job runner's and the webhook's liveness. The health call through the
    socket gets half the keep-alive period at most (5 s), so a slow answer still leaves time to send."""
    period = notifier.watchdog_s / 2 if notifier.watchdog_s else None
    timeout = min(5.0, period / 2) if period else 5.0

    def check() -> str | None:
        problems = [agent.liveness(timeout=timeout), runner.liveness() if runner is not None else None,
                    webhook.liveness() if webhook is not None else None]
        return "; ".join(p for p in problems if p) or None

    return KeepAlive(notifier, check, status=status)


def check(socket_path: Path, *, out: TextIO | None = None, err: TextIO | None = None, timeout: float = 3.0) -> int:
    """`trainwarden agent --check`: is an agent serving on `socket_path`? (Readiness and liveness probes.)"""
    out, err = out or sys.stdout, err or sys.stderr
    problem = check_agent(socket_path, timeout=timeout)
    if problem is not None:
        err.write(f"trainwarden: {problem}\n")
        return exit_codes.EXIT_AGENT_UNAVAILABLE
    out.write(f"agent serving on unix:{socket_path}\n")
    return exit_codes.EXIT_OK

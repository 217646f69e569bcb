"""What ``trainwarden run`` (agent/launch/run.py) starts beside the job before torchrun: etcd (an embedded one, or a
client of the one ``--etcd`` names) with the rendezvous settings torchrun gets for it, and the in-process node agent
with, for a job of several nodes, what it shares with the other nodes' agents. Each start registers its own cleanup
on the run's ExitStack; a start that cannot go on raises ``Abandon`` with the command's exit code.
"""

from __future__ import annotations

import shutil
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from trainwarden.agent.common import exit_codes
from trainwarden.agent.common.scratch import scratch_dir, sweep
from trainwarden.agent.etcd.client import EtcdAccessDenied
from trainwarden.agent.etcd.cluster import HangCoordinator, ProgressPublisher
from trainwarden.agent.etcd.embedded import EmbeddedEtcd, EtcdNotFoundError, EtcdStartError
from trainwarden.agent.etcd.job_records import EtcdUnavailable, JobRecords, connect
from trainwarden.agent.etcd.membership import live_nodes
from trainwarden.agent.etcd.writer import EtcdWriter
from trainwarden.agent.incidents.node_loss import NodeLossWatcher
from trainwarden.agent.launch.run_options import RunOptions
from trainwarden.agent.launch.torchrun import parse_nnodes
from trainwarden.agent.metrics.exporter import ExporterError
from trainwarden.agent.node.agent import AgentConfig, NodeAgent, watchdog_config
from trainwarden.agent.telemetry.server import TelemetryServerError

__all__ = ["MULTI_NODE_RDZV", "SPARE_JOIN_TIMEOUT_S", "Abandon", "EtcdSession", "embedded_etcd_dir",
           "start_etcd", "start_node_agent", "watch_peers"]


MULTI_NODE_RDZV = {"last_call_timeout": "3", "keep_alive_interval": "2", "keep_alive_max_attempt": "3"}
"""Rendezvous timings for jobs of several nodes, read by both rounds. torch's defaults (last call 30 s, a node
declared dead after 3 missed 5 s heartbeats) put 45 s into every recovery from a lost node; with these a
dead node leaves the rendezvous 4-6 s after it died, and a first round with at least MIN nodes closes 3 s
after the last one joined (a restart's round closes as soon as the previous round's living members are back).
On the native round (the default) the dead-node window is the node's lease TTL, 2 × 3 = 6 s, refreshed every
2 s by a keep-alive of its own; on torch's dynamic round each heartbeat is a compare-and-set on the one
rendezvous key, so N nodes make N/2 of them a second."""


SPARE_JOIN_TIMEOUT_S = 30 * 24 * 3600
"""With ``--spare-nodes``, torchrun's ``join_timeout``: a spare waits in the rendezvous for as long as the job runs
(it ends when the job's rendezvous closes), where the default 600 s would fail it after ten minutes."""


class Abandon(Exception):
    """A step of the run cannot go on: the command exits with ``code`` after saying ``message``."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class EtcdSession:
    """The run's etcd, once it answered."""

    endpoint: str
    """Every member, comma-separated: the rendezvous gets them all."""
    client: Any
    writer: EtcdWriter
    """Phase changes, incident copies and checkpoint pointers are queued here: no thread of the run waits for etcd."""
    records: JobRecords
    rdzv_conf: dict[str, str]
    """torchrun's rendezvous settings: the same security (the password's file, never the password) and timings."""


def embedded_etcd_dir(state_dir: Path) -> Path:
    """The embedded etcd's data: in the job's state directory (removed when the run ends, or by the next run
    after a kill), never a ``trainwarden-etcd-*`` directory left in the system's temporary directory."""
    return state_dir / "embedded-etcd"


def start_etcd(opts: RunOptions, *, state_dir: Path, logs: Path, run_record, node: str, out: TextIO,
               cleanup: ExitStack) -> EtcdSession:
    """An embedded etcd unless --etcd names one; a client checked to answer."""
    endpoint, security = opts.etcd, opts.etcd_security
    if endpoint is None and security.given:
        raise Abandon(exit_codes.EXIT_USAGE, "--etcd-ca/--etcd-cert/--etcd-key/--etcd-user/--etcd-password-file "
                      "(or TRAINWARDEN_ETCD_*) apply to an etcd named with --etcd; the embedded one makes its "
                      "own password")
    if endpoint is None:
        # its port is in every process's /proc/PID/cmdline: it requires a password only this user can read
        auth_dir = scratch_dir("trainwarden-etcd-")
        cleanup.callback(shutil.rmtree, auth_dir, True)  # after etcd.stop (registered below)
        data_dir = embedded_etcd_dir(state_dir)
        etcd = EmbeddedEtcd(data_dir=data_dir, log_path=logs / "etcd.log", auth_dir=auth_dir)
        cleanup.callback(shutil.rmtree, data_dir, True)  # after etcd.stop (registered below)
        try:
            etcd.start()
        except (EtcdNotFoundError, EtcdStartError) as exc:
            raise Abandon(exit_codes.EXIT_ETCD_UNAVAILABLE, str(exc)) from None
        cleanup.callback(etcd.stop)
        run_record.set("etcd", etcd.pid)
        endpoint, security = etcd.endpoint, etcd.security
        print(f"trainwarden: embedded etcd on {endpoint} (pid {etcd.pid}; user {security.user}, password in "
              f"{security.password_file})", file=out, flush=True)
    try:
        members = tuple(e.strip() for e in endpoint.split(",") if e.strip())
        config = security.config(members, timeout=5.0, connect_timeout=2.0)
    except ValueError as exc:
        raise Abandon(exit_codes.EXIT_USAGE, str(exc)) from None
    try:
        client = connect(config, hint="start etcd there, or leave out --etcd to use an embedded one")
        endpoint = ",".join(config.netlocs)  # the rendezvous gets every member too
    except (EtcdUnavailable, EtcdAccessDenied, ValueError) as exc:
        raise Abandon(exit_codes.EXIT_ETCD_UNAVAILABLE, str(exc)) from None
    rdzv_conf = security.rdzv_conf()  # the password's file, never the password
    if config.secure:
        rdzv_conf["protocol"] = "https"
    if parse_nnodes(opts.nnodes)[1] > 1:
        rdzv_conf.update(MULTI_NODE_RDZV)
    if opts.spare_nodes:  # a spare waits in the rendezvous as long as the job runs
        rdzv_conf["join_timeout"] = str(SPARE_JOIN_TIMEOUT_S)
    rdzv_conf["round"] = opts.rendezvous_round
    cleanup.callback(client.close)
    writer = EtcdWriter(client, endpoint=endpoint, node=node)
    cleanup.callback(writer.stop, 5.0)
    return EtcdSession(endpoint=endpoint, client=client, writer=writer, rdzv_conf=rdzv_conf,
                       records=JobRecords(client, endpoint=endpoint, writer=writer))


def start_node_agent(opts: RunOptions, *, node: str, etcd: EtcdSession, multi_node: bool,
                     cleanup: ExitStack) -> NodeAgent:
    """The in-process node agent, its socket in a private scratch directory. For a job of several nodes one node
    records each hang, naming the culprit from every node's view; it waits for the verdicts of the job's live
    members (``HangCoordinator``)."""
    sweep("trainwarden-")  # what runs that were SIGKILLed left (agent/common/scratch.py)
    sock_dir = scratch_dir("trainwarden-")
    cleanup.callback(shutil.rmtree, sock_dir, True)
    try:
        agent = NodeAgent(AgentConfig(socket_path=sock_dir / "agent.sock", metrics_host=opts.metrics_host,
                                      metrics_port=opts.metrics_port, state_home=opts.state_home, node=node,
                                      watchdog=watchdog_config(opts.straggler_policy, opts.hang_floor_s)),
                          etcd=etcd.writer, cluster=_hang_coordinator(etcd.client, node) if multi_node else None)
        agent.start()
    except (ExporterError, TelemetryServerError, ValueError) as exc:
        raise Abandon(exit_codes.EXIT_USAGE, f"cannot start the node agent: {exc}") from None
    cleanup.callback(agent.stop)
    return agent


def _hang_coordinator(client, node: str) -> HangCoordinator:
    return HangCoordinator(client, node, peers=lambda job: [n for n in live_nodes(client, job) if n != node])


def watch_peers(client, job: str, node: str, agent: NodeAgent, cleanup: ExitStack) -> None:
    """A job of several nodes: the other nodes' agents see this node's ranks (agent/etcd/cluster.py), and one
    ``node_lost`` incident is recorded per lost node (agent/incidents/node_loss.py)."""
    progress = ProgressPublisher(client, node, agent.job_telemetry.snapshot)
    progress.start()
    cleanup.callback(progress.stop)
    lost = NodeLossWatcher(client, job, node, agent.incidents.record)
    lost.start()
    cleanup.callback(lost.stop)

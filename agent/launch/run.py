"""`trainwarden run`: the all-in-one single-node default.

It starts (or connects to) etcd, records the job in it, launches torchrun with the etcd3
rendezvous and trainwarden's defaults, echoes and logs the job's output while tracking its
progress, and exits with the job's status after printing a summary (steps, restarts, time lost to
failures, where the checkpoints are).

SIGUSR1 asks the run to leave the job without losing a step (the node daemon's ``drain``): every worker of the
job saves after one agreed step and holds; once that checkpoint is committed this node stops its workers and
exits 0, and the other nodes regroup without it (a one-node job stops, resumable from that checkpoint).

Ctrl-C and SIGTERM stop everything this command started: torchrun is asked to stop its workers,
then anything it started that is still there is killed, then the embedded etcd is stopped. The
command exits 130 (SIGINT) or 143 (SIGTERM).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TextIO

import psutil

from trainwarden.agent.common import exit_codes
from trainwarden.agent.common.job_lifecycle import JobPhase, JobRecord
from trainwarden.agent.common.paths import job_state_dir
from trainwarden.agent.common.signals import StopOnSignals
from trainwarden.agent.common.netaddr import interface_of, route_address
from trainwarden.agent.etcd.client import EtcdAccessDenied, describe_etcd_error, split_endpoint
from trainwarden.agent.etcd.embedded import EmbeddedEtcd, EtcdNotFoundError, EtcdStartError
from trainwarden.agent.etcd.job_records import EtcdUnavailable, JobRecords, connect
from trainwarden.agent.etcd.cluster import HangCoordinator, ProgressPublisher
from trainwarden.agent.etcd.membership import NodeMembership, NodeTaken, admit, live_nodes
from trainwarden.agent.etcd.writer import EtcdWriter
from trainwarden.agent.incidents.node_loss import NodeLossWatcher
from trainwarden.agent.incidents.spare_takeover import SpareTakeover
from trainwarden.agent.incidents.worker_failures import WorkerFailureRecorder, describe_exit, describe_failures
from trainwarden.agent.launch.output import OutputPump
from trainwarden.agent.launch.process import TorchrunProcess
from trainwarden.agent.launch.elastic import EVENTS_FD_ENV, REPLY_FD_ENV
from trainwarden.agent.launch.events import LaunchEventReader
from trainwarden.agent.common.preflight import preflight
from trainwarden.agent.common.scratch import scratch_dir, sweep
from trainwarden.agent.launch.spare_swaps import SpareSwaps
from trainwarden.agent.launch.accounting import Accounting
from trainwarden.agent.launch.progress import JobProgress
from trainwarden.agent.launch.fencing import FENCED, EtcdRounds, Fencing
from trainwarden.agent.launch.links import LinkChecks
from trainwarden.agent.launch.memory_tier import MemoryTier, start_memory_tier
from trainwarden.agent.launch.regroup import _LEFT, Regrouping
from trainwarden.agent.launch.run_options import RunOptions
from trainwarden.agent.launch.run_record import RunRecord, RunRecordError
from trainwarden.agent.launch.worker_round import WorkerRound
from trainwarden.agent.launch.summary import print_summary
from trainwarden.agent.launch.torchrun import (LaunchSpec, parse_nnodes, torchelastic_log_dir, torchrun_command,
                                             worker_environment)
from trainwarden.agent.metrics.exporter import ExporterError
from trainwarden.agent.node.agent import AgentConfig, NodeAgent, watchdog_config
from trainwarden.agent.node.endpoints import AGENT_METRICS_RECORD, AGENT_SOCKET_RECORD
from trainwarden.agent.shared.atomic_file import atomic_write
from trainwarden.agent.common.paths import CHECKPOINT_DIR_RECORD
from trainwarden.agent.shared.contract import (CHECKPOINT_DIR_ENV, EXIT_ABORTED, EXIT_NUMERIC_STOP, EXIT_RESUME_BLOCKED,
                                              NUMERIC_POLICY_ENV, warm_parent,
                                              warm_paths)
from trainwarden.agent.shared.parent_death import SUPERVISOR_PID_ENV
from trainwarden.agent.telemetry.job_telemetry import steps_from
from trainwarden.agent.telemetry.server import TelemetryServerError

logger = logging.getLogger(__name__)

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
"""Where torch keeps its compile cache (inductor, triton): a directory of the run unless the user chose one."""

__all__ = ["RunOptions", "run"]


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


def sweep_killed_runs() -> None:
    """Remove what runs that were killed left on this machine: their private temp directories (``trainwarden-``,
    ``tw-warm-``) and memory snapshots (agent/launch/memory_tier.py). Only directories whose owner process is gone
    go; each run sweeps its own kind as it starts, this is for harnesses that kill whole simulated nodes."""
    from trainwarden.agent.launch.memory_tier import DEFAULT_ROOT, PREFIX

    for prefix in ("trainwarden-", "tw-warm-"):
        sweep(prefix)
    sweep(PREFIX, root=DEFAULT_ROOT)


def run(opts: RunOptions, *, out: TextIO = sys.stdout) -> int:
    """Run the job to its end (or until SIGINT/SIGTERM); returns the command's exit code."""
    job = _JobRun(opts, out)
    # signals outermost: a second Ctrl-C during cleanup (etcd, agent) must not interrupt it
    with StopOnSignals(on_first=_announce) as signals, ExitStack() as cleanup:
        previous_usr1 = signal.signal(signal.SIGUSR1, job.on_leave_signal)
        cleanup.callback(signal.signal, signal.SIGUSR1, previous_usr1)
        try:
            job.preflight()
            job.check_leftovers(cleanup)
            job.accounting.start_history(cleanup, nnodes=opts.nnodes, nproc_per_node=opts.nproc_per_node)
            job.start_etcd(cleanup)
            job.start_agent(cleanup)
            job.claim(signals, cleanup)
            job.accounting.continue_goodput(cleanup, job.client, job.writer)
            job.launch(cleanup)
            rc = job.supervise(signals)
            while rc is FENCED:  # cut off from etcd: the workers were stopped; rejoin as a new member
                job.wait_for_etcd(signals)
                job.launch(cleanup)
                rc = job.supervise(signals)
        except _Abandon as stop:
            if stop.message:
                print(f"trainwarden: {stop.message}", file=sys.stderr)
            return stop.code
        if rc is _LEFT:
            return exit_codes.EXIT_OK
        job.print_summary()
    return rc


"""``supervise``'s answer when this node lost etcd and stopped its workers (fencing)."""


class _Abandon(Exception):
    """A step of the run cannot go on: the command exits with ``code`` after saying ``message``."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message)
        self.code, self.message = code, message


def _announce(signum: int) -> None:
    print(f"\ntrainwarden: {signal.Signals(signum).name} received; stopping the job", file=sys.stderr, flush=True)


def _exit_code(signum: int) -> int:
    return exit_codes.EXIT_INTERRUPTED if signum == signal.SIGINT else exit_codes.EXIT_TERMINATED


class _JobRun(Regrouping, LinkChecks):
    """One `trainwarden run`, step by step; each step registers its own cleanup on the ExitStack."""

    def __init__(self, opts: RunOptions, out: TextIO) -> None:
        self.opts, self.out = opts, out
        self.state_dir = job_state_dir(opts.job, opts.state_home)
        self.logs = self.state_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.node = opts.node or socket.gethostname()
        self.record = JobRecord(job=opts.job, owner={"host": socket.gethostname(), "pid": os.getpid(),
                                                     "started": psutil.Process().create_time(), "node": self.node})
        self.membership: NodeMembership | None = None
        self.fenced = 0  # times this node was fenced (``_fence``)
        self.worker_round = WorkerRound()  # this node's current worker round: replaced as each one starts
        self._committed_step = 0  # the latest checkpoint step a local worker reported committed
        self._reported_checkpoint_dir: Path | None = None  # where the workers said they checkpoint
        self._failed_step = 0  # the latest checkpoint step a local worker reported failed (or fenced)
        self._reply_fd: int | None = None
        self._stand_in = None  # warm workers: a worker's pid -> the client pid it stands behind (``_warm_dir``)
        self._leave_asked = threading.Event()  # SIGUSR1: leave the job at a step boundary (a drain)
        self._left = threading.Event()  # this node's part is over: stop the workers, exit 0
        self._left_step: int | None = None
        self._leave_rounds: set = set()  # rounds whose leave request this node has acted on
        self._leave_done: dict = {}  # round -> Event set once that leave's checkpoint is settled
        self._asked_leave_round = None
        self._leave_cause, self._leave_reason = "drain", ""  # a policy's exclusion says "excluded" and why
        self._growing: threading.Thread | None = None
        self.progress = JobProgress()
        self.fencing = Fencing(job=opts.job, node=self.node, multi_node=self._multi_node,
                               worker_round=lambda: self.worker_round, pace=self.progress.median_step_seconds)
        self.accounting = Accounting(job=opts.job, node=self.node, state_dir=self.state_dir, out=out)
        self.goodput, self.history = self.accounting.goodput, self.accounting.history  # fed by the supervisor
        self._lock = threading.Lock()
        self.endpoint = ""
        self.client = None
        self.records: JobRecords | None = None
        self.agent: NodeAgent | None = None
        self.memory_tier: MemoryTier | None = None
        self.failures: WorkerFailureRecorder | None = None
        self.spares: SpareTakeover | None = None  # with --spare-nodes: names this node in the loss it replaced
        self.spare_swaps = SpareSwaps(opts.job, node=self.node)
        self.torchrun: TorchrunProcess | None = None
        self.pump: OutputPump | None = None
        self.events: LaunchEventReader | None = None
        self.config_error: str | None = None
        self.resume_blocked: str | None = None
        self.numeric_stop: str | None = None
        """Why the workers may not resume (their checkpoints cannot be read or loaded): the job stops, no restart."""
        self._resume_detail = ""
        self._startup_failure: tuple | None = None  # how the last round failed, if before its first step
        self._wake: threading.Event | None = None
        self.env: dict[str, str] = {}
        self.cmd: list[str] = []
        self.rdzv_conf: dict[str, str] = {}

    # ---- steps, in order ---------------------------------------------------------------------------

    def preflight(self) -> None:
        """What would make every worker fail at once is one clear error before anything starts."""
        problems = preflight(self.opts.script, {**os.environ, **self.opts.extra_env})
        if problems:
            raise _Abandon(exit_codes.EXIT_CONFIG, "; ".join(problems))

    def check_leftovers(self, cleanup: ExitStack) -> None:
        """Never beside a live run of the job or its leftovers on this host (agent/launch/run_record.py)."""
        self.run_record = RunRecord(self.state_dir)
        try:
            stopped = self.run_record.adopt_or_clear()
        except RunRecordError as exc:
            raise _Abandon(exit_codes.EXIT_USAGE, str(exc)) from None
        if stopped:
            print(f"trainwarden: stopped {len(stopped)} process(es) a killed run of job {self.opts.job} had left "
                  f"running (pids {', '.join(map(str, stopped))})", file=self.out, flush=True)
        self.run_record.set("supervisor", os.getpid())
        cleanup.callback(self.run_record.remove)
        for scratch in (torchelastic_log_dir(self.state_dir), self.embedded_etcd_dir):  # a killed run's, if any
            shutil.rmtree(scratch, ignore_errors=True)

    @property
    def embedded_etcd_dir(self) -> Path:
        """The embedded etcd's data: in the job's state directory (removed when the run ends, or by the next run
        after a kill), never a ``trainwarden-etcd-*`` directory left in the system's temporary directory."""
        return self.state_dir / "embedded-etcd"

    def start_etcd(self, cleanup: ExitStack) -> None:
        """An embedded etcd unless --etcd names one; a client checked to answer."""
        endpoint, security = self.opts.etcd, self.opts.etcd_security
        if endpoint is None and security.given:
            raise _Abandon(exit_codes.EXIT_USAGE, "--etcd-ca/--etcd-cert/--etcd-key/--etcd-user/--etcd-password-file "
                           "(or TRAINWARDEN_ETCD_*) apply to an etcd named with --etcd; the embedded one makes its "
                           "own password")
        if endpoint is None:
            # its port is in every process's /proc/PID/cmdline: it requires a password only this user can read
            auth_dir = scratch_dir("trainwarden-etcd-")
            cleanup.callback(shutil.rmtree, auth_dir, True)  # after etcd.stop (registered below)
            etcd = EmbeddedEtcd(data_dir=self.embedded_etcd_dir, log_path=self.logs / "etcd.log", auth_dir=auth_dir)
            cleanup.callback(shutil.rmtree, self.embedded_etcd_dir, True)  # after etcd.stop (registered below)
            try:
                etcd.start()
            except (EtcdNotFoundError, EtcdStartError) as exc:
                raise _Abandon(exit_codes.EXIT_ETCD_UNAVAILABLE, str(exc)) from None
            cleanup.callback(etcd.stop)
            self.run_record.set("etcd", etcd.pid)
            endpoint, security = etcd.endpoint, etcd.security
            print(f"trainwarden: embedded etcd on {endpoint} (pid {etcd.pid}; user {security.user}, password in "
                  f"{security.password_file})", file=self.out, flush=True)
        try:
            members = tuple(e.strip() for e in endpoint.split(",") if e.strip())
            config = security.config(members, timeout=5.0, connect_timeout=2.0)
        except ValueError as exc:
            raise _Abandon(exit_codes.EXIT_USAGE, str(exc)) from None
        try:
            self.client = connect(config, hint="start etcd there, or leave out --etcd to use an embedded one")
            self.endpoint = ",".join(config.netlocs)  # the rendezvous gets every member too
        except (EtcdUnavailable, EtcdAccessDenied, ValueError) as exc:
            raise _Abandon(exit_codes.EXIT_ETCD_UNAVAILABLE, str(exc)) from None
        # torchrun's rendezvous gets the same settings: the password's file, never the password
        self.rdzv_conf = security.rdzv_conf()
        if config.secure:
            self.rdzv_conf["protocol"] = "https"
        if parse_nnodes(self.opts.nnodes)[1] > 1:
            self.rdzv_conf.update(MULTI_NODE_RDZV)
        if self.opts.spare_nodes:  # a spare waits in the rendezvous as long as the job runs
            self.rdzv_conf["join_timeout"] = str(SPARE_JOIN_TIMEOUT_S)
        self.rdzv_conf["round"] = self.opts.rendezvous_round
        cleanup.callback(self.client.close)
        # phase changes, incident copies and checkpoint pointers are queued: no thread of the run waits for etcd
        self.writer = EtcdWriter(self.client, endpoint=self.endpoint, node=self.node)
        cleanup.callback(self.writer.stop, 5.0)
        self.records = JobRecords(self.client, endpoint=self.endpoint, writer=self.writer)

    def start_agent(self, cleanup: ExitStack) -> None:
        """The in-process node agent, and the records that let `status`/`top --job` find it."""
        opts = self.opts
        if not opts.agent:
            return
        sweep("trainwarden-")  # what runs that were SIGKILLed left (agent/common/scratch.py)
        sock_dir = scratch_dir("trainwarden-")
        cleanup.callback(shutil.rmtree, sock_dir, True)
        try:
            agent = NodeAgent(AgentConfig(socket_path=sock_dir / "agent.sock", metrics_host=opts.metrics_host,
                                          metrics_port=opts.metrics_port, state_home=opts.state_home,
                                          node=self.node,
                                          watchdog=watchdog_config(opts.straggler_policy, opts.hang_floor_s)),
                              etcd=self.writer, cluster=self._hang_coordinator())
            agent.start()
        except (ExporterError, TelemetryServerError, ValueError) as exc:
            raise _Abandon(exit_codes.EXIT_USAGE, f"cannot start the node agent: {exc}") from None
        cleanup.callback(agent.stop)
        self.agent = agent
        agent.registry.register(self.goodput)  # trainwarden_goodput_ratio, trainwarden_badput_seconds_total
        # trainwarden_job_spare_nodes, trainwarden_spare_swaps_total: on every job (0 without spares), so the job
        # dashboard's spares panel and any rule on them read 0 rather than nothing
        agent.registry.register(self.spare_swaps)
        self.accounting.register_mfu(agent, flops_per_step=opts.flops_per_step, model_params=opts.model_params,
                                     peak_tflops=opts.peak_tflops)
        if self._multi_node:  # only a worker of the job's current round publishes a checkpoint
            agent.server.commit_guard = self.fencing.commit_refusal
            self._ask_for_link_checks(agent)  # a communication regression asks for a link check
        if self._multi_node:  # the other nodes' agents see this node's ranks (agent/etcd/cluster.py)
            progress = ProgressPublisher(self.client, self.node, agent.job_telemetry.snapshot)
            progress.start()
            cleanup.callback(progress.stop)
            lost = NodeLossWatcher(self.client, opts.job, self.node, agent.incidents.record)  # one node_lost per loss
            lost.start()
            cleanup.callback(lost.stop)
            if opts.spare_nodes:  # "node n2 lost; spare n3 took ranks 2,3"
                self.spares = SpareTakeover(self.client, opts.job, self.node, agent.incidents.record,
                                            on_swap=lambda cause, _: self.spare_swaps.swapped(cause))
                cleanup.callback(self.spares.stop)
        self._write_record(cleanup, AGENT_SOCKET_RECORD, str(agent.config.socket_path))  # `status --job` reads it
        if agent.metrics_url:  # and `top --job` its GPU gauges, whatever port the run got
            self._write_record(cleanup, AGENT_METRICS_RECORD, agent.metrics_url)
        print(f"trainwarden: agent metrics at {agent.metrics_url}", file=self.out, flush=True)
        self.failures = WorkerFailureRecorder(
            opts.job, agent.incidents.record, node=self.node,
            ended_streams=lambda since: agent.job_telemetry.ended_streams(opts.job, since),
            killed_by_agent=agent.actions.killed_by_agent)
        agent.job_telemetry.add_listener(self)  # progress and phases from the workers' own reports
        agent.incidents.add_listener(self.accounting.on_incident)
        self.memory_tier = start_memory_tier(opts.job, agent, enabled=opts.memory_snapshots, cleanup=cleanup,
                                             out=self.out)

    def _hang_coordinator(self) -> HangCoordinator | None:
        """For a job of several nodes: one node records each hang, naming the culprit from every node's view;
        it waits for the verdicts of the job's live members."""
        if not self._multi_node:
            return None
        client, node = self.client, self.node
        return HangCoordinator(client, node, peers=lambda job: [n for n in live_nodes(client, job) if n != node])

    @property
    def local_addr(self) -> str | None:
        """What this node advertises: --local-addr, loopback for a one-node job, else the address of the
        interface that routes to etcd (never the host name: agent/common/netaddr.py)."""
        if self.opts.local_addr or parse_nnodes(self.opts.nnodes)[1] == 1:
            return self.opts.local_addr
        host, port, _ = split_endpoint(self.endpoint.split(",")[0])
        try:
            return route_address(host, port)
        except OSError as exc:
            raise _Abandon(exit_codes.EXIT_USAGE, f"no route to etcd at {self.endpoint} to pick this node's "
                           f"address from ({exc}); pass --local-addr ADDR") from None

    def _network_env(self) -> dict[str, str]:
        """Gloo binds the interface of the advertised address unless the user chose one (GLOO_SOCKET_IFNAME)."""
        env = dict(self.opts.extra_env)
        env[NUMERIC_POLICY_ENV] = self.opts.numeric_policy
        if self.memory_tier is not None:
            env.update(self.memory_tier.env())
        address = self.local_addr
        if address and "GLOO_SOCKET_IFNAME" not in os.environ and "GLOO_SOCKET_IFNAME" not in env:
            interface = interface_of(address)
            if interface:
                env["GLOO_SOCKET_IFNAME"] = interface
        return env

    def _compile_cache_env(self, cleanup: ExitStack) -> dict[str, str]:
        """The workers' torch compile cache in a scratch directory of this run, removed when it ends (swept by the
        next run after a SIGKILL): importing ``torch.distributed.pipelining`` makes ``$TMPDIR/torchinductor_<user>``
        otherwise, which outlives the job. A cache directory the user chose (TORCHINDUCTOR_CACHE_DIR) is kept."""
        if INDUCTOR_CACHE_ENV in os.environ or INDUCTOR_CACHE_ENV in self.opts.extra_env:
            return {}
        sweep("tw-inductor-")
        cache = scratch_dir("tw-inductor-")
        cleanup.callback(shutil.rmtree, cache, True)
        return {INDUCTOR_CACHE_ENV: str(cache)}

    def claim(self, signals: StopOnSignals, cleanup: ExitStack) -> None:
        """Enter the job in etcd as this node (agent/etcd/membership.py): refused while another live run holds
        this node; the first node of a (new) generation records the spec and resets the rendezvous, the
        others join the generation it started."""
        opts = self.opts
        spec = LaunchSpec(
            job=opts.job, script=opts.script, rdzv_endpoint=self.endpoint, state_dir=self.state_dir,
            agent_socket=str(self.agent.config.socket_path) if self.agent else None,
            nproc_per_node=opts.nproc_per_node, nnodes=opts.nnodes, max_restarts=opts.max_restarts,
            monitor_interval=opts.monitor_interval, local_addr=self.local_addr,
            extra_env={**self._network_env(), **self._compile_cache_env(cleanup)},
            rdzv_conf=self.rdzv_conf, warm_dir=self._warm_dir(cleanup), auto_instrument=opts.auto_instrument,
            tokens_per_step=opts.tokens_per_step,
        )
        try:
            self.env, self.cmd = worker_environment(spec), torchrun_command(spec)
        except ValueError as exc:
            raise _Abandon(exit_codes.EXIT_USAGE, str(exc)) from None
        try:
            admission, release = admit(self.client, opts.job, self.node)
        except NodeTaken as exc:
            raise _Abandon(exit_codes.EXIT_USAGE, str(exc)) from None
        except Exception as exc:  # TimeoutError, or etcd gone since connect()
            raise _Abandon(exit_codes.EXIT_ETCD_UNAVAILABLE, f"cannot enter job {opts.job} in etcd at "
                           f"{self.endpoint}: {describe_etcd_error(exc)}") from None
        try:
            previous = self.records.get_state(opts.job)
            if admission.starts_job:
                if not opts.managed:  # a submitted job's spec is the operator's (agent/etcd/jobs.py)
                    self.records.put_spec(opts.job, {
                        "command": opts.script, "nproc_per_node": opts.nproc_per_node, "nnodes": opts.nnodes,
                        "max_restarts": opts.max_restarts, "state_dir": str(self.state_dir),
                        "checkpoint_dir": str(self.checkpoint_dir),
                    })
                if previous is not None:
                    self._take_over(previous)
            else:
                self.record.generation = int((previous or {}).get("generation", 0))
                print(f"trainwarden: node {self.node} joins job {opts.job} (generation {self.record.generation}) "
                      f"beside {', '.join(sorted(admission.peers))}", file=self.out, flush=True)
            record = {"owner": self.record.owner, "address": self.local_addr or "",
                      "nproc_per_node": opts.nproc_per_node, "generation": self.record.generation,
                      "phase": JobPhase.STARTING.value}
            self._start_link_probe(record, cleanup)
            self.membership = NodeMembership(self.client, opts.job, self.node, record)
            self.membership.start()
            cleanup.callback(self.membership.stop)
            self.fencing.joined(self.membership, EtcdRounds(self.client, self.records, opts.job), self._stand_in)
        except Exception as exc:
            raise _Abandon(exit_codes.EXIT_ETCD_UNAVAILABLE, f"cannot enter job {opts.job} in etcd at "
                           f"{self.endpoint}: {describe_etcd_error(exc)}") from None
        finally:
            release()
        if signals.event.is_set():  # Ctrl-C during start-up: nothing launched yet
            self.transition(JobPhase.STOPPED, signal.Signals(signals.received).name)
            raise _Abandon(_exit_code(signals.received))
        self.transition(JobPhase.STARTING)

    def launch(self, cleanup: ExitStack) -> None:
        """torchrun in a session of its own, its output pumped to the terminal and the run log."""
        log_file = cleanup.enter_context(open(self.logs / "run.log", "a", buffering=1))
        events_read, events_write = os.pipe()  # the launcher's structured events (agent/launch/elastic.py)
        reply_read, reply_write = os.pipe()  # and our answers to it (``go`` before a membership restart)
        try:
            env = {**self.env, EVENTS_FD_ENV: str(events_write), REPLY_FD_ENV: str(reply_read),
                   SUPERVISOR_PID_ENV: str(os.getpid())}
            self.torchrun = TorchrunProcess(self.cmd, env,
                                            stdout=subprocess.PIPE, pass_fds=(events_write, reply_read))
        except OSError as exc:
            os.close(events_read)
            os.close(reply_write)
            self.transition(JobPhase.FAILED, str(exc))
            raise _Abandon(exit_codes.EXIT_LAUNCH_FAILED, f"cannot start torchrun: {exc}") from None
        finally:
            os.close(events_write)
            os.close(reply_read)
        self._reply_fd = reply_write
        cleanup.callback(os.close, reply_write)
        cleanup.callback(self.torchrun.stop)
        self.run_record.set("torchrun", self.torchrun.pid)
        atomic_write(self.state_dir / CHECKPOINT_DIR_RECORD, f"{self.checkpoint_dir.resolve()}\n".encode())
        if self.agent is not None:  # the workers the agent may ever signal descend from this torchrun
            self.agent.actions.register_launcher(self.opts.job, self.torchrun.pid)
        self.events = LaunchEventReader(events_read, self._on_launch_event)
        self.events.start()
        self.pump = OutputPump(self.torchrun.stdout, self.out, log_file, self._on_line)
        self.pump.start()

    def supervise(self, signals: StopOnSignals) -> int:
        """Wait for torchrun to end or a signal to stop it; the job's final phase and the exit code."""
        torchrun, pump = self.torchrun, self.pump
        self._wake = signals.event  # a configuration error found by the event reader ends the wait early too
        watching = threading.Event()  # the leave protocol polls etcd on a thread: this loop never waits on etcd
        watcher = threading.Thread(target=self._watch_leave_loop, args=(watching,), name="trainwarden-leave-watch",
                                   daemon=True)
        watcher.start()
        try:
            while torchrun.poll() is None and not signals.event.wait(0.5) and self.config_error is None \
                    and not self.fencing.cut_off() and not self._left.is_set():
                pass
        finally:
            watching.set()
        if self._left.is_set() and signals.received is None:
            return self._finish_leave()
        if signals.received is None and self.config_error is None and self.fencing.cut_off():
            return self._fence(f"lost etcd {self.membership.unconfirmed_for():.0f} s ago")
        if self.config_error is not None:  # the same failure twice before a step: restarting does not help
            self._stop_workers()
            if self.resume_blocked is not None:  # recorded by the agent as a resume_blocked incident
                return self._stop_resume_blocked()
            if self.numeric_stop is not None:  # recorded by the agent as a numeric incident
                return self._stop_numeric()
            print(f"trainwarden: {self.config_error}", file=self.out, flush=True)
            self.transition(JobPhase.FAILED, "configuration error: " + self.config_error[:200])
            if self.failures is not None:
                self.failures.job_failed("configuration error: the workers fail the same way before any step")
            return exit_codes.EXIT_CONFIG
        if signals.received is not None:
            self._stop_workers()
            self.transition(JobPhase.STOPPED, signal.Signals(signals.received).name)
            return _exit_code(signals.received)
        torchrun_rc = torchrun.wait()
        pump.join(10)
        self.events.join(5)
        if torchrun_rc != 0 and self.fencing.etcd_trouble():  # its rendezvous failed because etcd is away, not the job
            return self._fence(f"torchrun exited with {torchrun_rc} while etcd was unreachable")
        if torchrun_rc == 0:
            self.transition(JobPhase.SUCCEEDED)
            return exit_codes.EXIT_OK
        self.transition(JobPhase.FAILED, f"torchrun exited with {torchrun_rc}")
        if self.failures is not None:
            self.failures.job_failed(f"torchrun exited with {torchrun_rc}")
        return exit_codes.EXIT_JOB_FAILED

    @property
    def _multi_node(self) -> bool:
        return parse_nnodes(self.opts.nnodes)[1] > 1

    def _stop_workers(self, why: str = "stopped") -> None:
        """Stop torchrun and its workers, its output and events read to the end; the watchdog does not take their
        end for a hang."""
        if self.agent is not None:
            self.agent.watchdog.stand_down(self.opts.job, why)
        self.pump.quiet = True
        self.torchrun.stop(grace=10.0)
        self.pump.join(5)
        self.events.join(5)

    def _fence(self, why: str) -> object:
        """Stop this node's workers: they belong to a round the others have left (or are leaving). The node
        comes back only as a new member, through a new rendezvous (``wait_for_etcd``, then ``launch``)."""
        print(f"trainwarden: node {self.node} {why}: fencing (stopping its workers); it rejoins job "
              f"{self.opts.job} as a new member when etcd answers again", file=self.out, flush=True)
        self._stop_workers(f"fenced: {why}")
        self.pump.quiet = False
        if self.agent is not None:
            self.agent.incidents.record(self.fencing.incident(why))
        self.transition(JobPhase.RESTARTING, f"fenced: {why}")
        self.fenced += 1
        return FENCED

    def wait_for_etcd(self, signals: StopOnSignals) -> None:
        """Until etcd confirms this node's membership again (or a signal stops the run)."""
        started = time.monotonic()
        while self.fencing.etcd_trouble() or self.fencing.cut_off():
            if signals.event.wait(0.5):
                self.transition(JobPhase.STOPPED, signal.Signals(signals.received).name)
                raise _Abandon(_exit_code(signals.received))
        print(f"trainwarden: etcd answers again after {time.monotonic() - started:.0f} s; node {self.node} rejoins "
              f"job {self.opts.job}", file=self.out, flush=True)

    def print_summary(self) -> None:
        print_summary(self.out, record=self.record, state_dir=self.state_dir, progress=self.progress,
                      elapsed=time.monotonic() - self.started, ckpt_dir=self.checkpoint_dir,
                      log_path=self.logs / "run.log", steps_from=self._steps_from(),
                      goodput=self.goodput.snapshot(), mfu=self.accounting.mfu_line())

    def _steps_from(self) -> str | None:
        if self.agent is None:
            return None
        try:
            snaps = self.agent.job_telemetry.snapshot(self.opts.job)
        except Exception:
            return None
        return (steps_from(snaps[0].ranks) or None) if snaps else None

    # ---- helpers -----------------------------------------------------------------------------------

    @property
    def checkpoint_dir(self) -> Path:
        """Where the job's checkpoints are: where its workers said they checkpoint (``on_checkpoint``), else the
        directory the workers are given (``TRAINWARDEN_CHECKPOINT_DIR``: the spec's, the caller's, the default)."""
        return self._reported_checkpoint_dir or Path(self.env[CHECKPOINT_DIR_ENV])

    def _checkpoints_are_in(self, directory: Path) -> None:
        """A worker's Checkpointer said where it keeps the job's checkpoints: the record follows (``trainwarden
        checkpoints``, ``report`` and the summary read it). Nothing scans the script's arguments for a flag."""
        if directory == self.checkpoint_dir:
            return
        self._reported_checkpoint_dir = directory
        try:
            atomic_write(self.state_dir / CHECKPOINT_DIR_RECORD, f"{directory.resolve()}\n".encode())
        except OSError as exc:
            logger.warning("cannot record the checkpoint directory %s: %s", directory, exc)

    def _write_record(self, cleanup: ExitStack, name: str, value: str) -> None:
        path = self.state_dir / name
        atomic_write(path, (value + "\n").encode())
        cleanup.callback(path.unlink, missing_ok=True)

    def _take_over(self, previous: dict) -> None:
        """A job already in etcd and no node of it live: continue it with the next generation, or with the one
        `submit`/`resume` wrote in ``pending`` for the daemons to start. A non-terminal phase was left by runs
        that are gone (killed hard, or cut off from etcd for longer than their record's lease: those stop
        their workers themselves)."""
        opts, phase = self.opts, previous.get("phase")
        if phase not in [p.value for p in JobPhase if p.terminal] + [JobPhase.PENDING.value]:
            logger.warning("job %s was left %s by a trainwarden run that is gone (%s); taking over",
                           opts.job, phase, previous.get("owner"))
        fresh = phase == JobPhase.PENDING.value and opts.managed  # the generation the operator's request made
        self.record.generation = int(previous.get("generation", 0)) + (0 if fresh else 1)
        self.records.reset_rendezvous(opts.job)

    def transition(self, to: JobPhase, reason: str = "", *, failure: bool = True) -> None:
        with self._lock:  # publish under the lock too: puts from two threads must not land out of order
            if self.record.phase.terminal or self.record.phase == to:
                return
            self.record.transition(to, reason, failure=failure)
            if to.terminal:
                self.history.event("ended", phase=to.value, reason=reason[:300])
            self.records.put_state(self.opts.job, self.record.to_json())  # queued, in order: never waits
            if self.membership is not None:
                self.membership.update(phase=to.value, restarts=self.record.restarts)

    # ---- what the job reports -------------------------------------------------------------------------

    def _on_launch_event(self, event: dict) -> None:
        """The launcher's structured events: rounds, failures with exit codes, restarts."""
        kind, at = event.get("event"), float(event.get("t") or time.time())
        if kind == "started":
            self.worker_round = started = WorkerRound.started(self.record.generation, event)
            if self._multi_node and started.number is not None:  # the job's current round is this one now
                threading.Thread(target=self.fencing.advance_round, args=(started,), name="trainwarden-round",
                                 daemon=True).start()
            self.progress.round_started(at)
            if self.failures is not None:  # a later failure's evidence: this round's streams only
                self.failures.round_started(at)
            self.goodput.round_started(at, spare_swap=bool(event.get("spare_swap")))
            self.history.event("round_started", at, round=started.number, workers=len(event.get("workers") or []))
            self.run_record.set_workers(list(started.pids))
            if self.membership is not None:  # a node_lost incident names the ranks of the node's last round
                self.membership.update(ranks=list(started.ranks), round=started.number, spare=False)
            self.spare_swaps.waiting(False)  # trainwarden_job_spare_nodes: this node trains
            if self.spares is not None:
                self.spares.round_started(started.number, [w["global_rank"] for w in event.get("workers") or []])
        elif kind == "failed":
            self.progress.round_failed(at)
            self.goodput.failed(at)
            failures = event.get("failures") or []
            self.history.event("round_failed", at, failures=[
                {"rank": f.get("global_rank"), "exitcode": f.get("exitcode"), "message": str(f.get("message") or "")[:300]}
                for f in failures])
            if self._check_resume_blocked(failures) or self._check_numeric_stop(failures):
                return
            self._check_deterministic(failures)
            if self.failures is not None:
                self.failures.round_failed(failures)
            print(f"trainwarden: the worker round failed: {describe_failures(failures)}", file=self.out, flush=True)
        elif kind == "waiting":  # the round closed without this node: a hot spare, or a node that came late
            spare = "a hot spare: it takes a lost node's ranks" if self.opts.spare_nodes else \
                "it joins when the job grows"
            print(f"trainwarden: node {self.node} waits in round {event.get('round')} of job {self.opts.job}: the "
                  f"running round has its nodes; {spare}", file=self.out, flush=True)
            self.history.event("waiting", at, round=event.get("round"))
            if self.membership is not None:  # `trainwarden status --etcd` shows it as a spare
                self.membership.update(spare=True, ranks=[], round=event.get("round"))
            self.spare_swaps.waiting(True)  # trainwarden_job_spare_nodes
        elif kind == "membership_pending":  # nodes wait to join: checkpoint first, so no step is lost
            self._growing = threading.Thread(target=self._checkpoint_before_growing, args=(event.get("round"),),
                                             name="trainwarden-grow", daemon=True)
            self._growing.start()
        elif kind == "restarting":
            after_failure = event.get("reason") == "failed"
            self.progress.restarting(after_failure)
            if after_failure and self.failures is not None:
                self.failures.restarting()
            why = {"failed": "worker group failed", "regroup": "a node left the job"}.get(
                event.get("reason"), "nodes are waiting to join")
            print(f"trainwarden: restarting the worker group ({why}; {event.get('restarts_left', '?')} restarts "
                  "left)", file=self.out, flush=True)
            self.transition(JobPhase.RESTARTING, why, failure=after_failure)
            self.history.event("restarting", at, reason=event.get("reason") or "")

    def _check_resume_blocked(self, failures: list[dict]) -> bool:
        """Workers that exit with EXIT_RESUME_BLOCKED found checkpoints they may not start without: not a crash
        (no incident of that kind) and no restart; the job stops and says why (their own last words)."""
        blocked = [f for f in failures if int(f["exitcode"]) == EXIT_RESUME_BLOCKED]
        if not blocked:
            return False
        said = next((str(f.get("message")) for f in blocked if f.get("message")), "")
        self.resume_blocked = said or "its checkpoints exist but none could be read or loaded"
        self.config_error = self.resume_blocked
        if self._wake is not None:
            self._wake.set()
        return True

    def _check_numeric_stop(self, failures: list[dict]) -> bool:
        """Workers that exit with EXIT_NUMERIC_STOP computed non-finite values their numeric policy stops on: a
        restart would compute them again, so the job stops and says why (the first rank's words)."""
        stopped = [f for f in failures if int(f["exitcode"]) == EXIT_NUMERIC_STOP]
        if not stopped:
            return False
        said = next((str(f.get("message")) for f in stopped if f.get("message")), "")
        self.numeric_stop = self.config_error = said or "the training computed values that are not finite"
        if self._wake is not None:
            self._wake.set()
        return True

    def _stop_numeric(self) -> int:
        why = (self.numeric_stop or "")[:1500]
        print(f"trainwarden: the job stopped on non-finite values (--numeric-policy {self.opts.numeric_policy}): {why}\n"
              f"trainwarden: no restart was spent. `trainwarden incidents --job {self.opts.job}` has the numeric "
              f"incident; the workers' own output is in {self.logs / 'run.log'}", file=self.out, flush=True)
        self.transition(JobPhase.FAILED, "numeric stop: " + why[:300])
        return exit_codes.EXIT_NUMERIC_STOP

    def _stop_resume_blocked(self) -> int:
        why = (self._resume_detail or self.resume_blocked or "")[:1500]
        print(f"trainwarden: the job stopped rather than start over: {why}\ntrainwarden: no restart was spent. "
              f"`trainwarden checkpoints --job {self.opts.job}` lists its checkpoints and why each was set aside; "
              f"the workers' own output is in {self.logs / 'run.log'}", file=self.out, flush=True)
        self.transition(JobPhase.FAILED, "resume blocked: " + why[:300])
        return exit_codes.EXIT_RESUME_BLOCKED

    def _check_deterministic(self, failures: list[dict]) -> None:
        """A round that fails before its first step exactly as the previous one did is a configuration error
        (a missing file, a bad flag, an import error), not a fault a restart cures."""
        killed = self.agent.actions.killed_by_agent if self.agent is not None else (lambda pid: False)
        own = tuple(sorted((int(f["global_rank"]), int(f["exitcode"]), str(f.get("message") or "")[:300])
                           for f in failures if int(f["exitcode"]) not in (-signal.SIGTERM, EXIT_ABORTED)
                           and not killed(int(f.get("pid") or 0))))
        if self.progress.in_round or not own:
            self._startup_failure = None
            return
        if own == self._startup_failure and self.config_error is None:
            rank, code, message = own[0]
            self.config_error = (f"the workers failed the same way twice before their first step (rank {rank}: "
                                 f"{describe_exit(code)}{f': {message}' if message else ''}); this is a "
                                 "configuration error, not a transient fault: not restarting. See the job's log "
                                 f"({self.logs / 'run.log'}) for the workers' own output.")
            if self._wake is not None:
                self._wake.set()
        self._startup_failure = own

    def on_step(self, job: str, rank: int, pid: int, index: int, start_unix: float, duration_s: float) -> None:
        """A worker's step (telemetry listener, on the agent's reader thread)."""
        if job != self.opts.job:
            return
        self.fencing.worker_stepped()
        self.worker_round.stepped(index, start_unix + duration_s)
        self.goodput.step(index, start_unix + duration_s, duration_s)
        self.history.step(rank, index, start_unix + duration_s, duration_s)
        if self.progress.step(index, start_unix + duration_s, duration_s, worker=pid):
            self._round_running(index)

    def on_checkpoint(self, job: str, rank: int, stage: str, step: int, path: str, nbytes: int,
                      detail: str = "", seconds: float = 0.0) -> None:
        if job == self.opts.job and path and stage in ("restore_start", "committed"):  # the directory; a step's
            self._checkpoints_are_in(Path(path) if stage == "restore_start" else Path(path).parent)
        if job == self.opts.job and stage == "staged":
            self.goodput.checkpoint_stall(step, seconds)
        elif job == self.opts.job and stage == "restored":
            self.goodput.restored(seconds)
        if job == self.opts.job and stage == "committed":
            self._committed_step = max(self._committed_step, step)
        elif job == self.opts.job and stage == "failed":
            self._failed_step = max(self._failed_step, step)
        elif job == self.opts.job and stage == "resume_blocked" and detail:
            self._resume_detail = detail  # the committing rank's reason, in full

    def _warm_dir(self, cleanup: ExitStack) -> str | None:
        """A short private directory for the warm workers' zygote socket (unix socket paths are short)."""
        if not self.opts.warm_workers:
            print("trainwarden: cold workers: every restarted worker starts a new interpreter (--cold-workers)",
                  file=self.out, flush=True)
            return None
        print("trainwarden: warm workers: restarted workers fork from a process with torch and the script's imports "
              "loaded (--cold-workers turns this off)", file=self.out, flush=True)

        sweep("tw-warm-")
        warm = str(scratch_dir("tw-warm-"))
        cleanup.callback(shutil.rmtree, warm, True)
        workers = warm_paths(warm)[1]
        self._stand_in = lambda pid: warm_parent(pid, workers)  # the commit guard's too (fencing.py)
        if self.agent is not None:  # an aborted warm worker's SIGKILL is its client's death to torch's agent
            self.agent.actions.stand_in = self._stand_in
        return warm

    def _on_line(self, line: str) -> None:
        """Output lines: only a fallback for scripts that send no telemetry (progress.feed_line)."""
        seen = self.progress.feed_line(line)
        if seen is not None:
            self.fencing.worker_stepped()
        if seen is not None and seen[1]:
            self._round_running(seen[0])

    def _round_running(self, step: int) -> None:
        """The first step of a worker round completed."""
        self.transition(JobPhase.RUNNING)
        if self.failures is not None:
            self.failures.resumed(step)

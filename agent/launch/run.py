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
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TextIO

import psutil

from trainwarden.agent.common import exit_codes
from trainwarden.agent.common.job_lifecycle import JobPhase, JobRecord
from trainwarden.agent.common.netaddr import route_address
from trainwarden.agent.common.paths import CHECKPOINT_DIR_RECORD, job_state_dir
from trainwarden.agent.common.preflight import preflight
from trainwarden.agent.common.signals import StopOnSignals
from trainwarden.agent.etcd.client import split_endpoint
from trainwarden.agent.etcd.job_records import JobRecords
from trainwarden.agent.etcd.membership import NodeMembership
from trainwarden.agent.incidents.spare_takeover import SpareTakeover
from trainwarden.agent.incidents.worker_failures import WorkerFailureRecorder
from trainwarden.agent.launch.accounting import Accounting
from trainwarden.agent.launch.fencing import FENCED, EtcdRounds, Fencing
from trainwarden.agent.launch.job_entry import enter_job
from trainwarden.agent.launch.launched import Launched
from trainwarden.agent.launch.links import LinkChecks
from trainwarden.agent.launch.memory_tier import MemoryTier, start_memory_tier
from trainwarden.agent.launch.process import TorchrunProcess
from trainwarden.agent.launch.progress import JobProgress
from trainwarden.agent.launch.regroup import LEFT, EtcdLeaves, Regrouping
from trainwarden.agent.launch.round_events import RoundEvents
from trainwarden.agent.launch.run_options import RunOptions
from trainwarden.agent.launch.run_record import RunRecord, RunRecordError
from trainwarden.agent.launch.services import (MULTI_NODE_RDZV, Abandon, EtcdSession, embedded_etcd_dir, start_etcd,
                                              start_node_agent, watch_peers)
from trainwarden.agent.launch.spare_swaps import SpareSwaps
from trainwarden.agent.launch.stop_verdict import StopVerdict
from trainwarden.agent.launch.summary import print_summary, step_source
from trainwarden.agent.launch.torchrun import (LaunchSpec, parse_nnodes, torchelastic_log_dir, torchrun_command,
                                             worker_environment)
from trainwarden.agent.launch.worker_setup import compile_cache_env, network_env, sweep_killed_runs, warm_dir
from trainwarden.agent.node.agent import NodeAgent
from trainwarden.agent.node.endpoints import AGENT_METRICS_RECORD, AGENT_SOCKET_RECORD
from trainwarden.agent.shared.atomic_file import atomic_write
from trainwarden.agent.shared.contract import CHECKPOINT_DIR_ENV
from trainwarden.agent.shared.parent_death import SUPERVISOR_PID_ENV

logger = logging.getLogger(__name__)

__all__ = ["MULTI_NODE_RDZV", "RunOptions", "run", "sweep_killed_runs"]  # services.py's, worker_setup.py's: as before


def run(opts: RunOptions, *, out: TextIO = sys.stdout) -> int:
    """Run the job to its end (or until SIGINT/SIGTERM); returns the command's exit code."""
    job = _JobRun(opts, out)
    # signals outermost: a second Ctrl-C during cleanup (etcd, agent) must not interrupt it
    with StopOnSignals(on_first=_announce) as signals, ExitStack() as cleanup:
        previous_usr1 = signal.signal(signal.SIGUSR1, job.regroup.on_leave_signal)
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
        except Abandon as stop:
            if stop.message:
                print(f"trainwarden: {stop.message}", file=sys.stderr)
            return stop.code
        if rc is LEFT:
            return exit_codes.EXIT_OK
        job.print_summary()
    return rc


def _announce(signum: int) -> None:
    print(f"\ntrainwarden: {signal.Signals(signum).name} received; stopping the job", file=sys.stderr, flush=True)


def _exit_code(signum: int) -> int:
    return exit_codes.EXIT_INTERRUPTED if signum == signal.SIGINT else exit_codes.EXIT_TERMINATED


class _JobRun:
    """One `trainwarden run`, step by step (each registers its cleanup); it acts on the decisions of its parts."""

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
        self._reported_checkpoint_dir: Path | None = None  # where the workers said they checkpoint
        self.launched: Launched | None = None  # the current start of torchrun (``launch``)
        self._log_file: TextIO | None = None  # the run log, open for the whole run
        self._stand_in = None  # warm workers: a worker's pid -> the client pid it stands behind (``_warm_dir``)
        self.progress = JobProgress()
        self.fencing = Fencing(job=opts.job, node=self.node, multi_node=self._multi_node,
                               worker_round=lambda: self.rounds.current, pace=self.progress.median_step_seconds)
        self.regroup = Regrouping(job=opts.job, node=self.node, multi_node=self._multi_node, out=out,
                                  worker_round=lambda: self.rounds.current, pace=self.progress.median_step_seconds)
        self.links = LinkChecks(job=opts.job, node=self.node, policy=opts.link_policy, out=out,
                                leaving=lambda: self.regroup.leave_asked,
                                leave=lambda reason: self.regroup.ask_to_leave("excluded", reason))
        self.accounting = Accounting(job=opts.job, node=self.node, state_dir=self.state_dir, out=out)
        self.goodput, self.history = self.accounting.goodput, self.accounting.history  # fed by the supervisor
        self._lock = threading.Lock()
        self.etcd: EtcdSession | None = None  # start_etcd (services.py); its parts below, as the steps use them
        self.endpoint, self.client = "", None
        self.records: JobRecords | None = None
        self.agent: NodeAgent | None = None
        self.memory_tier: MemoryTier | None = None
        self.failures: WorkerFailureRecorder | None = None
        self.spares: SpareTakeover | None = None  # with --spare-nodes: names this node in the loss it replaced
        self.spare_swaps = SpareSwaps(opts.job, node=self.node)
        self.verdict = StopVerdict(job=opts.job, numeric_policy=opts.numeric_policy, log_path=self.logs / "run.log",
                                   out=out)  # when restarting cannot help
        self.rounds = RoundEvents(job=opts.job, node=self.node, spare_nodes=opts.spare_nodes,
                                  multi_node=self._multi_node, out=out, progress=self.progress,
                                  accounting=self.accounting, verdict=self.verdict, spare_swaps=self.spare_swaps,
                                  generation=lambda: self.record.generation, advance_round=self.fencing.advance_round,
                                  before_growing=self.regroup.before_growing, transition=self.transition)
        self.env: dict[str, str] = {}
        self.cmd: list[str] = []
        self.rdzv_conf: dict[str, str] = {}

    # ---- steps, in order ---------------------------------------------------------------------------

    def preflight(self) -> None:
        """What would make every worker fail at once is one clear error before anything starts."""
        problems = preflight(self.opts.script, {**os.environ, **self.opts.extra_env})
        if problems:
            raise Abandon(exit_codes.EXIT_CONFIG, "; ".join(problems))

    def check_leftovers(self, cleanup: ExitStack) -> None:
        """Never beside a live run of the job or its leftovers on this host (agent/launch/run_record.py)."""
        self.run_record = RunRecord(self.state_dir)
        try:
            stopped = self.run_record.adopt_or_clear()
        except RunRecordError as exc:
            raise Abandon(exit_codes.EXIT_USAGE, str(exc)) from None
        if stopped:
            print(f"trainwarden: stopped {len(stopped)} process(es) a killed run of job {self.opts.job} had left "
                  f"running (pids {', '.join(map(str, stopped))})", file=self.out, flush=True)
        self.run_record.set("supervisor", os.getpid())
        cleanup.callback(self.run_record.remove)
        for scratch in (torchelastic_log_dir(self.state_dir), embedded_etcd_dir(self.state_dir)):
            shutil.rmtree(scratch, ignore_errors=True)  # a killed run's, if any

    def start_etcd(self, cleanup: ExitStack) -> None:
        """An embedded etcd unless --etcd names one; a client checked to answer (services.py)."""
        self.etcd = start_etcd(self.opts, state_dir=self.state_dir, logs=self.logs, run_record=self.run_record,
                               node=self.node, out=self.out, cleanup=cleanup)
        self.endpoint, self.client, self.records = self.etcd.endpoint, self.etcd.client, self.etcd.records
        self.writer, self.rdzv_conf = self.etcd.writer, self.etcd.rdzv_conf

    def start_agent(self, cleanup: ExitStack) -> None:
        """The in-process node agent, and the records that let `status`/`top --job` find it."""
        opts = self.opts
        if not opts.agent:
            return
        self.agent = agent = start_node_agent(opts, node=self.node, etcd=self.etcd, multi_node=self._multi_node,
                                              cleanup=cleanup)
        agent.registry.register(self.goodput)  # trainwarden_goodput_ratio, trainwarden_badput_seconds_total
        # trainwarden_job_spare_nodes, trainwarden_spare_swaps_total: on every job (0 without spares), so the job
        # dashboard's spares panel and any rule on them read 0 rather than nothing
        agent.registry.register(self.spare_swaps)
        self.accounting.register_mfu(agent, flops_per_step=opts.flops_per_step, model_params=opts.model_params,
                                     peak_tflops=opts.peak_tflops)
        if self._multi_node:  # only a worker of the job's current round publishes a checkpoint
            agent.server.commit_guard = self.fencing.commit_refusal
            self.links.ask_on_regression(agent.watchdog, self.client)  # a regression asks for a link check
        if self._multi_node:  # the other nodes' agents see this node's ranks; one node_lost per loss
            watch_peers(self.client, opts.job, self.node, agent, cleanup)
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
            raise Abandon(exit_codes.EXIT_USAGE, f"no route to etcd at {self.endpoint} to pick this node's "
                           f"address from ({exc}); pass --local-addr ADDR") from None

    def claim(self, signals: StopOnSignals, cleanup: ExitStack) -> None:
        """torchrun's command line and the workers' environment, then enter the job in etcd as this node
        (job_entry.py); fencing and the leave protocol act from then on."""
        opts = self.opts
        spec = LaunchSpec(
            job=opts.job, script=opts.script, rdzv_endpoint=self.endpoint, state_dir=self.state_dir,
            agent_socket=str(self.agent.config.socket_path) if self.agent else None,
            nproc_per_node=opts.nproc_per_node, nnodes=opts.nnodes, max_restarts=opts.max_restarts,
            monitor_interval=opts.monitor_interval, local_addr=self.local_addr,
            extra_env={**network_env(opts, memory_tier_env=self.memory_tier.env() if self.memory_tier else {},
                                     address=self.local_addr), **compile_cache_env(opts.extra_env, cleanup)},
            rdzv_conf=self.rdzv_conf, warm_dir=self._warm_dir(cleanup), auto_instrument=opts.auto_instrument,
            tokens_per_step=opts.tokens_per_step,
        )
        try:
            self.env, self.cmd = worker_environment(spec), torchrun_command(spec)
        except ValueError as exc:
            raise Abandon(exit_codes.EXIT_USAGE, str(exc)) from None
        self.membership = enter_job(opts, etcd=self.etcd, node=self.node, record=self.record, spec={
            "command": opts.script, "nproc_per_node": opts.nproc_per_node, "nnodes": opts.nnodes,
            "max_restarts": opts.max_restarts, "state_dir": str(self.state_dir),
            "checkpoint_dir": str(self.checkpoint_dir),
        }, address=self.local_addr, out=self.out, cleanup=cleanup, serve_probe=lambda mine: self.links.serve_probe(
            mine, cleanup, self.local_addr if self._multi_node else None))
        self.fencing.joined(self.membership, EtcdRounds(self.client, self.records, opts.job), self._stand_in)
        self.regroup.joined(EtcdLeaves(self.client, self.records, opts.job, self.node),
                            checkpoint=self._checkpoint_request(), reply=self._reply,
                            launcher_running=lambda: self.torchrun is not None and self.torchrun.poll() is None)
        if signals.event.is_set():  # Ctrl-C during start-up: nothing launched yet
            self.transition(JobPhase.STOPPED, signal.Signals(signals.received).name)
            raise Abandon(_exit_code(signals.received))
        self.transition(JobPhase.STARTING)

    def launch(self, cleanup: ExitStack) -> None:
        """torchrun in a session of its own, its output pumped to the terminal and the run log. A fenced node's
        earlier launch is closed first: what it held goes back now, not at the run's end (agent/launch/launched.py)."""
        if self._log_file is None:
            self._log_file = cleanup.enter_context(open(self.logs / "run.log", "a", buffering=1))
            cleanup.callback(self._close_launch)
        self._close_launch()
        try:
            self.launched = Launched(self.cmd, {**self.env, SUPERVISOR_PID_ENV: str(os.getpid())}, out=self.out,
                                     log=self._log_file, on_line=self._on_line, on_event=self.rounds.on_event)
        except OSError as exc:
            self.transition(JobPhase.FAILED, str(exc))
            raise Abandon(exit_codes.EXIT_LAUNCH_FAILED, f"cannot start torchrun: {exc}") from None
        self.run_record.set("torchrun", self.torchrun.pid)
        atomic_write(self.state_dir / CHECKPOINT_DIR_RECORD, f"{self.checkpoint_dir.resolve()}\n".encode())
        if self.agent is not None:  # the workers the agent may ever signal descend from this torchrun
            self.agent.actions.register_launcher(self.opts.job, self.torchrun.pid)
        self.rounds.attach(run_record=self.run_record, failures=self.failures, membership=self.membership,
                           spares=self.spares, killed=self.agent.actions.killed_by_agent if self.agent else None)
        self.launched.start_reading()

    def _close_launch(self) -> None:
        if self.launched is not None:
            self.launched.close()

    @property
    def torchrun(self) -> TorchrunProcess | None:
        return self.launched.torchrun if self.launched is not None else None

    def supervise(self, signals: StopOnSignals) -> int:
        """Wait for torchrun to end or a signal to stop it; the job's final phase and the exit code."""
        torchrun = self.torchrun
        self.verdict.wake = signals.event  # a configuration error found by the event reader ends the wait early too
        watching = threading.Event()  # the leave protocol polls etcd on a thread: this loop never waits on etcd
        watcher = threading.Thread(target=self.regroup.watch, args=(watching,), name="trainwarden-leave-watch",
                                   daemon=True)
        watcher.start()
        try:
            while torchrun.poll() is None and not signals.event.wait(0.5) and self.verdict.reason is None \
                    and not self.fencing.cut_off() and not self.regroup.left:
                pass
        finally:
            watching.set()
        if self.regroup.left and signals.received is None:
            return self._finish_leave()
        if signals.received is None and self.verdict.reason is None and self.fencing.cut_off():
            return self._fence(f"lost etcd {self.membership.unconfirmed_for():.0f} s ago")
        if self.verdict.reason is not None:  # resume blocked, a numeric stop, the same failure twice before a step
            self._stop_workers()
            return self.verdict.stop(self.transition, self.failures)
        if signals.received is not None:
            self._stop_workers()
            self.transition(JobPhase.STOPPED, signal.Signals(signals.received).name)
            return _exit_code(signals.received)
        torchrun_rc = torchrun.wait()
        self.launched.join(output_s=10)
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

    def _stop_workers(self, why: str | None = "stopped") -> None:
        """Stop torchrun and its workers, its output and events read to the end; the watchdog does not take their
        end for a hang (``why``; None: a leave, whose stop it is not told of, as before the regroup part moved)."""
        if self.agent is not None and why is not None:
            self.agent.watchdog.stand_down(self.opts.job, why)
        self.launched.stop(grace=10.0)

    def _finish_leave(self) -> object:
        """This node left the job (``Regrouping``): stop its workers; a one-node job stops, resumable."""
        self._stop_workers(None)  # SIGTERM: torchrun does not close the rendezvous on a signal
        saved = self.regroup.left_words()
        if self._multi_node:
            print(f"trainwarden: node {self.node} left job {self.opts.job} {saved}; the job goes on without it",
                  file=self.out, flush=True)
            return LEFT
        self.transition(JobPhase.STOPPED, f"drained {saved}")
        print(f"trainwarden: job {self.opts.job} stopped {saved} (its node was drained); resume it on another "
              "node from that checkpoint", file=self.out, flush=True)
        return LEFT

    def _checkpoint_request(self):
        """What asks this node's workers to save after a step and hold (the ranks asked); None without the agent."""
        if self.agent is None:
            return None
        actions, job = self.agent.actions, self.opts.job
        return lambda step: actions.request_checkpoint(job, step, hold=True)

    def _reply(self, line: bytes) -> None:
        """Answer torchrun on its reply pipe (``go``, ``restart <round>``: agent/launch/elastic.py)."""
        if self.launched is not None:
            self.launched.reply(line)

    def _fence(self, why: str) -> object:
        """Stop this node's workers: they belong to a round the others have left (or are leaving). The node
        comes back only as a new member, through a new rendezvous (``wait_for_etcd``, then ``launch``)."""
        print(f"trainwarden: node {self.node} {why}: fencing (stopping its workers); it rejoins job "
              f"{self.opts.job} as a new member when etcd answers again", file=self.out, flush=True)
        self._stop_workers(f"fenced: {why}")
        self.launched.pump.quiet = False
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
                raise Abandon(_exit_code(signals.received))
        print(f"trainwarden: etcd answers again after {time.monotonic() - started:.0f} s; node {self.node} rejoins "
              f"job {self.opts.job}", file=self.out, flush=True)

    def print_summary(self) -> None:
        print_summary(self.out, record=self.record, state_dir=self.state_dir, progress=self.progress,
                      elapsed=time.monotonic() - self.started, ckpt_dir=self.checkpoint_dir,
                      log_path=self.logs / "run.log", steps_from=step_source(self.agent, self.opts.job),
                      goodput=self.goodput.snapshot(), mfu=self.accounting.mfu_line())

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

    def on_step(self, job: str, rank: int, pid: int, index: int, start_unix: float, duration_s: float) -> None:
        """A worker's step (telemetry listener, on the agent's reader thread)."""
        if job != self.opts.job:
            return
        self.fencing.worker_stepped()
        self.rounds.current.stepped(index, start_unix + duration_s)
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
        if job == self.opts.job:
            self.regroup.checkpoint_reported(stage, step)
        if job == self.opts.job and stage == "resume_blocked" and detail:
            self.verdict.checkpoint_detail(detail)

    def _warm_dir(self, cleanup: ExitStack) -> str | None:
        """The warm workers' zygote directory (worker_setup.py); the commit guard and the agent get their stand-ins."""
        warm, self._stand_in = warm_dir(self.opts.warm_workers, self.out, cleanup)
        if self._stand_in is not None and self.agent is not None:
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

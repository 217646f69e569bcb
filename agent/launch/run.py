"""`trainwarden run`: the all-in-one single-node default.

It starts (or connects to) etcd, records the job in it, launches torchrun with the etcd3
rendezvous and trainwarden's defaults, echoes and logs the job's output while tracking its
progress, and exits with the job's status after printing a summary (steps, restarts, time lost to
failures, where the checkpoints are).

Ctrl-C and SIGTERM stop everything this command started: torchrun is asked to stop its workers,
then anything it started that is still there is killed, then the embedded etcd is stopped. The
command exits 130 (SIGINT) or 143 (SIGTERM).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import psutil

from trainwarden.agent.common import exit_codes
from trainwarden.agent.etcd.client import split_endpoint
from trainwarden.agent.etcd.embedded import EmbeddedEtcd, EtcdNotFoundError, EtcdStartError
from trainwarden.agent.metrics.exporter import ExporterError
from trainwarden.agent.proto.atomic_file import atomic_write
from trainwarden.agent.incidents.store import list_incidents
from trainwarden.agent.common.job_lifecycle import JobPhase, JobRecord, supervisor_gone
from trainwarden.agent.etcd.job_records import JobStore, JobStoreUnavailable, connect
from trainwarden.agent.launch.torchrun import LaunchSpec, TorchrunProcess, torchrun_command, validate_launch, worker_environment
from trainwarden.agent.node.agent import AgentConfig, NodeAgent, watchdog_config
from trainwarden.agent.common.paths import job_state_dir
from trainwarden.agent.launch.progress import RESTART_LINE, STEP_LINE, ProgressTracker
from trainwarden.agent.incidents.worker_failures import RestartRecorder
from trainwarden.agent.cli.status import AGENT_METRICS_RECORD, AGENT_SOCKET_RECORD
from trainwarden.agent.telemetry.server import TelemetryServerError

logger = logging.getLogger(__name__)

__all__ = ["RunOptions", "run"]


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """What `trainwarden run` was asked to do."""

    script: list[str]
    """The worker command: ``[path, args...]`` or ``["-m", module, args...]``."""
    job: str
    """Job name."""
    nproc_per_node: int = 1
    """Workers on this node."""
    nnodes: str = "1"
    """``N`` or ``MIN:MAX``."""
    etcd: str | None = None
    """``host:port`` (or ``http://host:port``) of a running etcd; None starts an embedded one."""
    max_restarts: int = 3
    """Worker-group restarts before the job fails."""
    monitor_interval: float = 1.0
    """Seconds between torchrun's health checks of its workers."""
    state_home: Path | None = None
    """Root of job state directories (default: see ``paths.default_state_home``)."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """More environment for the workers."""
    local_addr: str | None = None
    """Address this node advertises in the rendezvous; None: loopback for a one-node job, else the hostname."""
    agent: bool = True
    """Run a node agent in-process (telemetry, metrics, watchdog)."""
    metrics_host: str = "127.0.0.1"
    """Address of the agent's Prometheus endpoint."""
    metrics_port: int = 9478
    """Port of the agent's Prometheus endpoint (0: a free one)."""
    straggler_policy: str = "alert"
    """``alert`` or ``exclude`` (also ask for this node's exclusion at the next rendezvous)."""

    def __post_init__(self) -> None:
        validate_launch(self)


def _endpoint(url: str) -> str:
    host, port, _ = split_endpoint(url)
    return f"{host}:{port}"


def _checkpoint_dir(script: list[str], env: dict[str, str]) -> Path:
    for i, arg in enumerate(script):
        if arg == "--ckpt-dir" and i + 1 < len(script):
            return Path(script[i + 1])
        if arg.startswith("--ckpt-dir="):
            return Path(arg.split("=", 1)[1])
    return Path(env["TRAINWARDEN_CHECKPOINT_DIR"])


class _Signals:
    """Turns SIGINT/SIGTERM into an event the main loop waits on; restores handlers on exit."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "_Signals":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            print(f"\ntrainwarden: {signal.Signals(signum).name} received; stopping the job", file=sys.stderr, flush=True)
        self.event.set()

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# torchrun's own INFO lines (glog style, "I1122 14:37:14.328000 ...") go to the log file only
_TORCHRUN_INFO = re.compile(r"^\[?I\d{4} \d\d:\d\d:\d\d")


class _OutputPump(threading.Thread):
    """Copies torchrun's output to our stdout and the run log, feeding the progress tracker."""

    def __init__(self, source, sink: TextIO, log: TextIO, tracker: ProgressTracker, on_line) -> None:
        super().__init__(name="trainwarden-output", daemon=True)
        self._source, self._sink, self._log = source, sink, log
        self._tracker, self._on_line = tracker, on_line
        self.quiet = False
        """Set while stopping: torchrun's shutdown tracebacks go to the log, not the terminal."""

    def run(self) -> None:
        for raw in iter(self._source.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            try:
                self._log.write(line)
                if not self.quiet and (not _TORCHRUN_INFO.match(line) or RESTART_LINE.search(line)):
                    self._sink.write(line)
                    self._sink.flush()
                self._tracker.feed(line)
                self._on_line(line)
            except Exception:  # a broken terminal must not stop the job's log or the tracker
                logger.exception("error while handling job output")


def run(opts: RunOptions, *, out: TextIO = sys.stdout) -> int:
    state_dir = job_state_dir(opts.job, opts.state_home)
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    record = JobRecord(job=opts.job, owner={"host": socket.gethostname(), "pid": os.getpid(),
                                            "started": psutil.Process().create_time()})
    tracker = ProgressTracker()
    lock = threading.Lock()

    # signals outermost: a second Ctrl-C during cleanup (etcd, agent) must not interrupt it
    with _Signals() as signals, ExitStack() as stack:
        # etcd: embedded unless told otherwise
        if opts.etcd is None:
            etcd = EmbeddedEtcd(log_path=logs / "etcd.log")
            try:
                etcd.start()
            except (EtcdNotFoundError, EtcdStartError) as exc:
                print(f"trainwarden: {exc}", file=sys.stderr)
                return exit_codes.EXIT_ETCD_UNAVAILABLE
            stack.callback(etcd.stop)
            endpoint = etcd.endpoint
            print(f"trainwarden: embedded etcd on {endpoint} (pid {etcd.pid})", file=out, flush=True)
        else:
            endpoint = opts.etcd
        try:
            client = connect(endpoint)  # validates [http://]host:port, and that etcd answers
            endpoint = _endpoint(endpoint)
        except (JobStoreUnavailable, ValueError) as exc:
            print(f"trainwarden: {exc}", file=sys.stderr)
            return exit_codes.EXIT_ETCD_UNAVAILABLE
        stack.callback(client.close)
        store = JobStore(client, endpoint=endpoint)

        agent_socket, agent = None, None
        if opts.agent:
            sock_dir = Path(tempfile.mkdtemp(prefix="trainwarden-"))
            stack.callback(shutil.rmtree, sock_dir, True)
            try:
                agent = NodeAgent(AgentConfig(socket_path=sock_dir / "agent.sock", metrics_host=opts.metrics_host,
                                              metrics_port=opts.metrics_port, state_home=opts.state_home,
                                              watchdog=watchdog_config(opts.straggler_policy)),
                                  etcd_client=client)
                agent.start()
            except (ExporterError, TelemetryServerError, ValueError) as exc:
                print(f"trainwarden: cannot start the node agent: {exc}", file=sys.stderr)
                return exit_codes.EXIT_USAGE
            stack.callback(agent.stop)
            agent_socket = str(agent.config.socket_path)
            # `trainwarden status/top --job` find this run's agent through this record
            socket_record = state_dir / AGENT_SOCKET_RECORD
            atomic_write(socket_record, (agent_socket + "\n").encode())  # `status --job` may read it now
            stack.callback(socket_record.unlink, missing_ok=True)
            if agent.metrics_url:  # and `top --job` its GPU gauges, whatever port the run got
                metrics_record = state_dir / AGENT_METRICS_RECORD
                atomic_write(metrics_record, (agent.metrics_url + "\n").encode())
                stack.callback(metrics_record.unlink, missing_ok=True)
            print(f"trainwarden: agent metrics at {agent.metrics_url}", file=out, flush=True)

        spec = LaunchSpec(
            job=opts.job, script=opts.script, rdzv_endpoint=endpoint, state_dir=state_dir, agent_socket=agent_socket,
            nproc_per_node=opts.nproc_per_node, nnodes=opts.nnodes, max_restarts=opts.max_restarts,
            monitor_interval=opts.monitor_interval, extra_env=opts.extra_env,
            local_addr=opts.local_addr,
        )
        env = worker_environment(spec)
        cmd = torchrun_command(spec)

        def publish() -> None:
            try:
                store.put_state(opts.job, record.to_json())
            except JobStoreUnavailable as exc:
                logger.warning("%s", exc)

        def transition(to: JobPhase, reason: str = "") -> None:
            with lock:  # publish under the lock too: puts from two threads must not land out of order
                if record.phase.terminal or record.phase == to:
                    return
                record.transition(to, reason)
                publish()

        restarts = RestartRecorder(opts.job, agent.incidents.record,
                                   ended_streams=lambda since: agent.jobstate.ended_streams(opts.job, since)) \
            if agent is not None else None

        def on_line(line: str) -> None:
            restarting = bool(RESTART_LINE.search(line))
            step = STEP_LINE.search(line)
            if restarts is not None:
                restarts.feed(line, restarting=restarting, step=int(step.group(1)) if step else None)
            if restarting:
                transition(JobPhase.RESTARTING, "worker group failed")
            elif step and record.phase in (JobPhase.STARTING, JobPhase.RESTARTING):
                transition(JobPhase.RUNNING)

        try:
            store.put_spec(opts.job, {
                "command": opts.script, "nproc_per_node": opts.nproc_per_node, "nnodes": opts.nnodes,
                "max_restarts": opts.max_restarts, "state_dir": str(state_dir),
                "checkpoint_dir": str(_checkpoint_dir(opts.script, env)),
            })
        except JobStoreUnavailable as exc:
            print(f"trainwarden: {exc}", file=sys.stderr)
            return exit_codes.EXIT_ETCD_UNAVAILABLE
        try:
            previous = store.get_state(opts.job)
            if previous is not None:
                phase = previous.get("phase")
                if phase not in (p.value for p in JobPhase if p.terminal):
                    if not supervisor_gone(previous.get("owner") or {}, host=socket.gethostname()):
                        print(f"trainwarden: job {opts.job} is already {phase} in etcd at {endpoint} "
                              f"(supervised by {previous.get('owner') or 'an unknown process'}); stop that run "
                              "first or choose another --job", file=sys.stderr)
                        return exit_codes.EXIT_USAGE
                    logger.warning("job %s was left %s by a trainwarden run that is gone (%s); taking over",
                                   opts.job, phase, previous.get("owner"))
                record.generation = int(previous.get("generation", 0)) + 1
                store.reset_rendezvous(opts.job)
        except JobStoreUnavailable as exc:
            print(f"trainwarden: {exc}", file=sys.stderr)
            return exit_codes.EXIT_ETCD_UNAVAILABLE
        if signals.event.is_set():  # Ctrl-C during start-up: nothing launched yet
            transition(JobPhase.STOPPED, signal.Signals(signals.received).name)
            return exit_codes.EXIT_INTERRUPTED if signals.received == signal.SIGINT else exit_codes.EXIT_TERMINATED
        transition(JobPhase.STARTING)

        log_file = stack.enter_context(open(logs / "run.log", "a", buffering=1))
        try:
            torchrun = TorchrunProcess(cmd, env, stdout=subprocess.PIPE)
        except OSError as exc:
            print(f"trainwarden: cannot start torchrun: {exc}", file=sys.stderr)
            transition(JobPhase.FAILED, str(exc))
            return exit_codes.EXIT_LAUNCH_FAILED
        stack.callback(torchrun.stop)
        pump = _OutputPump(torchrun.stdout, out, log_file, tracker, on_line)
        pump.start()

        while torchrun.poll() is None and not signals.event.wait(0.5):
            pass

        if signals.received is not None:
            pump.quiet = True
            torchrun.stop(grace=10.0)
            pump.join(5)
            transition(JobPhase.STOPPED, signal.Signals(signals.received).name)
            rc = exit_codes.EXIT_INTERRUPTED if signals.received == signal.SIGINT else exit_codes.EXIT_TERMINATED
        else:
            torchrun_rc = torchrun.wait()
            pump.join(10)
            if torchrun_rc == 0:
                transition(JobPhase.SUCCEEDED)
                rc = exit_codes.EXIT_OK
            else:
                transition(JobPhase.FAILED, f"torchrun exited with {torchrun_rc}")
                if restarts is not None:
                    restarts.job_failed(f"torchrun exited with {torchrun_rc}")
                rc = exit_codes.EXIT_JOB_FAILED
        _summary(out, opts, record, tracker, time.monotonic() - started,
                 _checkpoint_dir(opts.script, env), logs / "run.log")
    return rc


def _latest_checkpoint(directory: Path) -> str:
    pointer = directory / "latest"
    try:
        info = json.loads(pointer.read_text())
        return f"latest complete: step {info['step']}"
    except FileNotFoundError:
        return "none committed"
    except (ValueError, KeyError, OSError) as exc:
        return f"unreadable pointer {pointer}: {exc}"


def _summary(out: TextIO, opts: RunOptions, record: JobRecord, tracker: ProgressTracker,
             elapsed: float, ckpt_dir: Path, log_path: Path) -> None:
    lines = [f"trainwarden: job {opts.job} {record.phase.value} after {elapsed:.1f}s"]
    if tracker.max_step is not None:
        median = tracker.median_step_seconds()
        lines.append(f"  steps        last step {tracker.max_step}, last loss {tracker.last_loss}, "
                     f"median step {median:.3f}s")
    else:
        lines.append("  steps        none reported (the script prints no 'step N loss X time Ys' lines)")
    if tracker.failures:
        parts = []
        for f in tracker.failures:
            lost = f"{f.lost_seconds:.1f}s lost" if f.lost_seconds is not None else "not recovered"
            where = f"failed after step {f.last_step}" if f.last_step is not None else "failed before any step"
            resumed = f", resumed at step {f.resumed_from}" if f.resumed_from is not None else ""
            parts.append(f"{where}{resumed}, {lost}")
        lines.append(f"  restarts     {tracker.restarts} ({'; '.join(parts)})")
        lines.append(f"  time lost    {tracker.lost_seconds:.1f}s to failures")
    else:
        lines.append("  restarts     0")
    lines.append(f"  checkpoints  {ckpt_dir} ({_latest_checkpoint(ckpt_dir)})")
    incidents = _incident_summary(opts)
    if incidents:
        lines.append(f"  incidents    {incidents} (trainwarden incidents --job {opts.job})")
    lines.append(f"  log          {log_path}")
    print("\n".join(lines), file=out, flush=True)


def _incident_summary(opts: RunOptions) -> str:
    """"hang 1 (rank 2), crash 1, ..." from the job's incident records; "" when there are none."""
    try:
        found = list_incidents(job_state_dir(opts.job, opts.state_home))
    except (OSError, ValueError) as exc:
        return f"unreadable ({exc})"
    kinds: dict[str, list] = {}
    for incident in found:
        kinds.setdefault(incident.kind.value, []).append(incident)
    parts = []
    for kind, items in sorted(kinds.items()):
        ranks = sorted({r for i in items for r in i.ranks})
        named = f" (rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))})" if \
            ranks and kind != "restart" else ""
        parts.append(f"{kind} {len(items)}{named}")
    return ", ".join(parts)

"""The training script's handle on trainwarden: `init()` and `Session`.

    dist.init_process_group(...)
    rt = trainwarden.runtime.init(mesh={"pp": 2, "tp": 2, "dp": 2})
    for step in range(start, steps):
        with rt.step(step, tokens=batch_tokens):
            with rt.phase("forward"):
                ...
        if rt.take_checkpoint_request(step):
            save()
    rt.close()

`init()` reads TRAINWARDEN_AGENT_SOCKET (no socket: a no-op session with the same API), TRAINWARDEN_JOB
(or `job=`, else torchrun's TORCHELASTIC_RUN_ID), rank and world size from torch.distributed when it is
initialized and from torchrun's environment otherwise.

The step context is the hot path (runtime/step_context.py): two clock reads on entry, one on exit and a tuple
appended to the client's bounded deque. It never raises (an exception from the training step passes through
untouched).

Agent commands arrive on the client's thread. Each is queued for `poll_command()` and handled there:
DumpDiagnostics writes faulthandler stacks of every thread to `<dir>/rank<R>.stacks` (after a first line
`# trainwarden main_thread=0x...` naming the training thread in faulthandler's format) and the Flight
Recorder trace to `<dir>/rank<R>.fr`; CheckpointNow is answered by `take_checkpoint_request(step)` at the
step boundary it names (every rank the same step: the save is collective), and with ``hold`` the next
`step()` waits there, reported as the ``held`` checkpoint stage, until the launcher restarts the workers
(the job grows by a node, with no step lost) or HOLD_LIMIT_S passes; Abort logs the reason, flushes
telemetry and exits the process with EXIT_ABORTED.

A child forked from the worker (DataLoader workers, ``os.fork``) inherits the session but not the client's
thread nor gRPC's: in the child the session turns into the no-op one and never calls into gRPC again;
the parent's stream is untouched. Leave GRPC_ENABLE_FORK_SUPPORT unset (gRPC's default): with it, every
fork waits for gRPC's threads (about 1 s each, measured with a streaming client).
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from trainwarden.agent.shared.contract import (AGENT_SOCKET_ENV, JOB_ENV, MAIN_THREAD_HEADER, NUMERIC_KINDS, stacks_file,
                                             trace_file, validate_job_name)

from trainwarden.agent.shared.parent_death import LAUNCHER_PID_ENV, die_with_parent

from .cuda_timing import CudaStepTimer, cuda_in_use, gpu_uuid
from .flight_recorder import FlightRecorder
from .step_context import NULL_CONTEXT, PhaseContext, StepContext
from .abort import abort_process
from .agent_client import (CHECKPOINT_RECORD, CHECKPOINT_STAGES, EXIT_ABORTED, NUMERIC_RECORD, ClientConfig,
                           TelemetryClient)
from .agent_requests import ask_checkpoint_record, ask_commit, ask_memory_held, ask_memory_steps
from trainwarden.agent.shared import telemetry_pb2 as _pb

__all__ = ["AGENT_SOCKET_ENV", "JOB_ENV", "Command", "EXIT_ABORTED", "Session", "current", "goodbye", "init"]

log = logging.getLogger(__name__)

FR_DUTY_ENV = "TRAINWARDEN_FR_MAX_DUTY"
"""Override of the longest share of wall time the Flight Recorder reads may take (ClientConfig.fr_max_duty)."""
_COMMANDS_KEPT = 64
HOLD_LIMIT_S = 120.0
"""The longest a worker waits at a step boundary after a checkpoint with ``hold``; then it trains on (the
restart it waited for did not come: the launcher gave up on it, or died)."""


@dataclass(frozen=True)
class Command:
    """An agent command as seen by the training loop."""

    kind: str
    """"dump_diagnostics", "checkpoint_now" or "abort"."""
    argument: str = ""
    """The diagnostics directory, the abort reason, or the step a checkpoint is requested after."""


class Session:
    """Step timing, telemetry and agent commands for one worker; a no-op when `client` is None."""

    def __init__(self, *, job: str, rank: int, world_size: int, client_config: ClientConfig | None,
                 hello: "object | None" = None, flight_recorder: FlightRecorder | None = None) -> None:
        self.job, self.rank, self.world_size = job, rank, world_size
        self._fr = flight_recorder if flight_recorder is not None else FlightRecorder()
        self._commands: queue.Queue[Command] = queue.Queue(maxsize=_COMMANDS_KEPT)
        self._phases: dict | None = None
        self.checkpoint_requested = False
        self._checkpoint_request: tuple[int, bool] | None = None  # (step or 0, hold) of the last CheckpointNow
        self._hold_after: int | None = None  # start no step after this one (a checkpoint with hold)
        self.hold_limit_s = HOLD_LIMIT_S
        self._client: TelemetryClient | None = None
        self._cuda: CudaStepTimer | None = None  # from the first step with CUDA in use (cuda_timing.py)
        self._cuda_off = False
        self._manual_steps = False  # the script called step(): auto-instrumentation's hooks stop counting
        self.step_source = getattr(hello, "step_source", "") or "rt.step"
        if client_config is not None:
            self._client = TelemetryClient(client_config, hello, on_command=self._on_command,
                                           flight_recorder=self._fr)
            self._client.start()
            _watch_exit(self)

    @property
    def enabled(self) -> bool:
        return self._client is not None

    @property
    def stats(self) -> dict[str, int | float]:
        """The telemetry client's counters: records dropped, reconnects, messages sent, the sender's wake-ups
        (``drains``), the wake-ups that held the steps back (``held``, runtime/send_pace.py), Flight Recorder reads
        and the CPU seconds they took, entries overwritten before a read, and the dumps the still-thread check took
        (`ThreadWatch.check`, runtime/thread_watch.py) and their CPU seconds."""
        c = self._client  # None: every counter 0
        counts = {name: getattr(c, name, 0) for name in ("dropped", "reconnects", "sent", "drains", "held",
                                                         "fr_reads", "still_reads")}
        seconds = {name: round(getattr(c, name, 0.0), 6) for name in ("fr_read_cpu_s", "still_read_cpu_s")}
        return {**counts, **seconds, "fr_missed": self._fr.missed if c is not None and self._fr else 0}

    def _gpu_begin(self):
        """At a step boundary: a CUDA event token for `_emit_step`, once this process uses CUDA (the timer
        and the GPU's UUID for the agent come with the first such step); None without CUDA. Never raises."""
        timer = self._cuda
        if timer is None:
            if self._client is None or self._cuda_off or not cuda_in_use():
                return None
            try:
                timer = self._cuda = CudaStepTimer(self._client.record)
                self._update_hello(gpu_uuid=gpu_uuid())
            except Exception as exc:  # steps keep their CPU times
                log.warning("CUDA step timing is off: %s", exc)
                self._cuda, self._cuda_off = None, True
                return None
        return timer.begin()

    def _emit_step(self, record: tuple, token) -> None:
        """Queue a finished step: behind its GPU end event when CUDA timing is on, else to the client now."""
        timer = self._cuda
        if timer is not None:
            timer.end(token, record)
        elif self._client is not None:
            self._client.record(record)

    def step(self, index: int, *, tokens: int = 0):
        """Context manager around one training step."""
        if self._client is None:
            return NULL_CONTEXT
        if not self._manual_steps:
            self._take_over_steps()
        return StepContext(self, index, tokens)

    def _take_over_steps(self) -> None:
        """The script reports its own steps: auto-instrumentation's optimizer hooks stop, and the agent hears
        where steps come from now."""
        self._manual_steps = True
        if self.step_source != "rt.step":
            self.step_source = "rt.step"
            self._update_hello(step_source="rt.step")

    def _update_hello(self, *, mesh: Mapping[str, int] | None = None, step_source: str | None = None,
                      gpu_uuid: str | None = None) -> None:
        if self._client is not None:
            self._client.update_hello(mesh=mesh, step_source=step_source, gpu_uuid=gpu_uuid)

    def phase(self, name: str):
        """Context manager around a part of the step ("forward", "backward", "optimizer")."""
        if self._client is None:
            return NULL_CONTEXT
        return PhaseContext(self, name)

    def checkpoint_event(self, stage: str, step: int, seconds: float = 0.0, bytes: int = 0, path: str = "",
                         detail: str = "") -> None:
        """Report a checkpoint stage (``CHECKPOINT_STAGES``: save_start, staged, written, committed, failed,
        set_aside, restore_start, restored). With ``committed``, give the checkpoint's ``path``: the agent publishes
        it as the job's latest in etcd; ``failed`` and ``set_aside`` carry a ``detail`` for their incident. A loop
        with its own background writes reports ``written`` on every rank when its write ends: until then the hang
        deadline allows for the steps a write slows. ``trainwarden.runtime.checkpoint.Checkpointer`` reports its
        own stages."""
        code = CHECKPOINT_STAGES.get(stage)
        if code is None:
            raise ValueError(f"unknown checkpoint stage {stage!r}; use one of {sorted(CHECKPOINT_STAGES)}")
        if self._client is not None:
            self._client.record_soon((CHECKPOINT_RECORD, code, int(step), float(seconds), int(bytes), str(path),
                                      str(detail)[:2000]))

    def numeric_guard(self, **options):
        """A ``NumericGuard`` that reports through this session (runtime/numeric.py; ``options`` are its own):

            guard = rt.numeric_guard()
            ...backward...
            if guard.check(step, loss=my_local_loss, parameters=model.parameters()):
                optimizer.step()           # False: a NaN, an Inf or a loss spike: every rank skips this update

        The policy comes from ``trainwarden run --numeric-policy`` unless ``policy=`` is given. With a fused optimizer
        on a GPU, ``check(..., optimizer=optimizer)`` defers the check: True every step, the skip taken on the device,
        the incident a step later; ``guard.flush()`` when the loop ends."""
        from .numeric import NumericGuard

        return NumericGuard(self, **options)

    def numeric_event(self, kind: str, step: int, *, first_rank: int, action: str, detail: str = "") -> None:
        """Report a numeric event (``NUMERIC_KINDS``: ``nan``, ``loss_spike``) of ``step``, first seen on
        ``first_rank`` (-1: on every rank, where it arose unknown), and what the job did (``rolled_back``, ``stopped``, ``alerted``): the agent records one
        ``numeric`` incident. ``trainwarden.runtime.numeric.NumericGuard`` reports its own."""
        if kind not in NUMERIC_KINDS:
            raise ValueError(f"unknown numeric event {kind!r}; use one of {NUMERIC_KINDS}")
        if self._client is not None:
            self._client.record_soon((NUMERIC_RECORD, kind, int(step), int(first_rank), str(action)[:64],
                                      str(detail)[:2000]))

    def poll_command(self) -> Command | None:
        """The oldest agent command not yet polled, or None (never blocks)."""
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def take_checkpoint_request(self, step: int | None = None) -> bool:
        """True when the loop should save a checkpoint now, after step ``step``: once per CheckpointNow, at
        the step it names. A request for a step this rank has already passed cannot be honoured (the other
        ranks save at that step or already did): it is logged and dropped. Without ``step`` only a request
        for "the next boundary" is answered (older scripts; safe for one rank only)."""
        request = self._checkpoint_request
        if request is None:
            return False
        wanted, hold = request
        if wanted == 0:
            due = True
        elif step is None or step < wanted:
            return False
        else:
            due = step == wanted
            if not due:
                log.warning("checkpoint requested after step %d arrived after step %d; not saving it", wanted, step)
        self._checkpoint_request, self.checkpoint_requested = None, False
        if due and hold:
            self._hold_after = step if step is not None else wanted
        return due

    def commit_refusal(self, step: int, path: str = "", bytes: int = 0) -> str | None:
        """Why this rank may not publish the checkpoint of ``step`` as the job's latest, or None when it may:
        the node's agent checks that this worker's rendezvous round is still the job's current one (DESIGN:
        fenced rounds). No agent, or one that does not answer, refuses nothing: a one-node job has no round
        to check, and an agent that is away must not stop checkpoints."""
        if self._client is None:
            return None
        reply = ask_commit(self._client.config.socket_path, _pb.CommitRequest(
            job=self.job, rank=self.rank, step=int(step), path=str(path), bytes=int(bytes)))
        if reply is None or reply.allowed:
            return None
        return reply.reason or "refused by the node agent"

    def committed_record(self) -> tuple[int | None, str, str]:
        """(step, path, source) of the checkpoint etcd's job record says was committed, asked of the node
        agent; (None, "", why) when none or unknown (no agent, or one without etcd). A restore's evidence
        (runtime/checkpoint/resume_evidence.py)."""
        if self._client is None:
            return None, "", "unknown (no node agent)"
        return ask_checkpoint_record(self._client.config.socket_path, self.job)

    def memory_steps(self, world_size: int) -> list[int]:
        """The steps of this rank's in-memory snapshots at ``world_size`` that its node agent (which owns the
        memory) holds, newest first (runtime/checkpoint/memory_snapshot.py); empty without an agent or snapshots."""
        if self._client is None:
            return []
        return ask_memory_steps(self._client.config.socket_path, self.job, world_size, self.rank)

    def memory_held(self, world_size: int) -> list[tuple[int, int, int]]:
        """(world size, rank, step) of every in-memory snapshot file its node agent vouches for, of every rank on
        this node (runtime/checkpoint/memory_reshard.py); empty without an agent or snapshots."""
        if self._client is None:
            return []
        return ask_memory_held(self._client.config.socket_path, self.job, world_size, self.rank)

    def _hold(self, index: int) -> None:
        """Wait before step ``index``: the launcher restarts the workers once the checkpoint this rank just
        saved is committed (HOLD_LIMIT_S bounds the wait). An Abort still ends the process meanwhile."""
        held = self._hold_after
        self._hold_after = None
        log.info("holding before step %d: the job restarts with a new membership from the checkpoint of step %d",
                 index, held)
        self.checkpoint_event("held", held)
        deadline = time.monotonic() + self.hold_limit_s
        while time.monotonic() < deadline:
            time.sleep(min(0.2, self.hold_limit_s))
        log.warning("held %.0f s before step %d and no restart came; training on", self.hold_limit_s, index)

    def dump_diagnostics(self, directory: str | os.PathLike) -> list[Path]:
        """Write this rank's stacks and Flight Recorder trace into `directory`; returns the files.

        Each file appears complete or not at all (written under a temporary name, then renamed), stacks
        first. The trace has no per-entry stack traces (see `FlightRecorder.dump_raw`)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        stacks = out / stacks_file(self.rank)
        partial = stacks.with_name(stacks.name + ".partial")
        with open(partial, "w") as f:
            # names the training thread among faulthandler's "Thread 0x..." blocks (same format)
            f.write(MAIN_THREAD_HEADER.format(ident=threading.main_thread().ident) + "\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        partial.replace(stacks)
        written = [stacks]
        try:
            trace = self._fr.dump_raw()
        except Exception as exc:  # the recorder failing must not stop the stacks from being useful
            log.warning("flight recorder dump failed: %s", exc)
            trace = None
        if trace is not None:
            fr = out / trace_file(self.rank)
            partial = fr.with_name(fr.name + ".partial")
            partial.write_bytes(trace)
            partial.replace(fr)
            written.append(fr)
        return written

    def close(self, reason: str = "closed", timeout: float = 2.0) -> None:
        if self._cuda is not None:  # the steps the GPU is still finishing, before the stream closes
            self._cuda.close(timeout=timeout / 2)
        if self._client is not None:
            self._client.close(timeout=timeout, reason=reason)

    def _detach_in_forked_child(self) -> None:
        """In a child forked from this worker (a DataLoader worker, a user's ``os.fork``): the client's
        thread and gRPC's own threads did not survive the fork, and its channel shares the parent's
        connection. The child goes quiet: steps, phases and checkpoint events are no-ops and closing
        (also at the child's exit) touches nothing. The client object is kept, never finalized here:
        its destructor would call into gRPC's copied state."""
        if self._client is not None:
            _ABANDONED_IN_CHILD.append(self._client)
            self._client = None

    def _on_command(self, message) -> None:
        kind = message.WhichOneof("command")
        if kind == "dump_diagnostics":
            command = Command(kind, message.dump_diagnostics.dir)
            if command.argument:
                self.dump_diagnostics(command.argument)
        elif kind == "checkpoint_now":
            request = message.checkpoint_now
            command = Command(kind, str(request.step) if request.step else "")
            self._checkpoint_request = (max(0, int(request.step)), bool(request.hold))
            self.checkpoint_requested = True
        elif kind == "abort":
            command = Command(kind, message.abort.reason)
            client = self._client
            abort_process(command.argument, lambda: client.flush(1.0) if client else None)
        else:
            log.warning("ignoring unknown agent command %r", kind)
            return
        try:
            self._commands.put_nowait(command)
        except queue.Full:
            log.warning("agent command %s not kept: %d commands not polled", kind, _COMMANDS_KEPT)


def init(job: str | None = None, *, mesh: Mapping[str, int] | None = None,
         socket_path: str | None = None, env: Mapping[str, str] | None = None, step_source: str = "rt.step",
         **client_options) -> Session:
    """Start telemetry for this worker (call after `init_process_group`); see the module docstring.

    In a worker trainwarden instrumented by itself (runtime/auto.py), the session already exists: it is
    returned, told the script's ``mesh``, and the script's ``rt.step`` calls then count the steps."""
    env = os.environ if env is None else env
    existing = _auto_session()
    if existing is not None and step_source == "rt.step":
        if job and job != existing.job:
            log.warning("trainwarden: init(job=%r) in a worker already reporting as job %r; keeping %r", job,
                        existing.job, existing.job)
        if mesh:
            existing._update_hello(mesh=mesh)
        return existing
    rank, world_size = _rank_and_world(env)
    job = job or env.get(JOB_ENV) or env.get("TORCHELASTIC_RUN_ID") or "default"
    socket_path = socket_path or env.get(AGENT_SOCKET_ENV)
    if not socket_path:
        return _remember(Session(job=job, rank=rank, world_size=world_size, client_config=None))
    launcher = env.get(LAUNCHER_PID_ENV)
    if launcher and launcher.isdigit():  # started by trainwarden's launcher: die with it, even if killed hard
        die_with_parent(signal.SIGKILL, int(launcher))
    try:
        validate_job_name(job)
    except ValueError as exc:  # the agent would refuse the stream: say so here, and train on without telemetry
        log.error("trainwarden: %s; telemetry is off for this worker (set %s to a valid name)", exc, JOB_ENV)
        return _remember(Session(job=job, rank=rank, world_size=world_size, client_config=None))
    from trainwarden.agent.shared import telemetry_pb2 as pb

    hello = pb.Hello(job=job, rank=rank, local_rank=int(env.get("LOCAL_RANK", "0")), world_size=world_size,
                     mesh=dict(mesh or {}), pid=os.getpid(),
                     restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                     hostname=socket.gethostname(), step_source=step_source)
    if env.get(FR_DUTY_ENV) and "fr_max_duty" not in client_options:
        try:
            client_options["fr_max_duty"] = float(env[FR_DUTY_ENV])
        except ValueError:
            raise ValueError(f"{FR_DUTY_ENV}={env[FR_DUTY_ENV]!r} is not a number (e.g. 0.002)") from None
    config = ClientConfig(socket_path=socket_path, **client_options)
    if str(env.get("GRPC_ENABLE_FORK_SUPPORT", "")).lower() in ("1", "true", "yes"):
        log.warning("trainwarden: GRPC_ENABLE_FORK_SUPPORT is set: every fork of this worker (a DataLoader "
                    "worker) waits for gRPC's threads, about 1 s each with telemetry streaming; unset it: "
                    "trainwarden's client goes quiet in forked children by itself")
    return _remember(Session(job=job, rank=rank, world_size=world_size, client_config=config, hello=hello))


def _rank_and_world(env: Mapping[str, str]) -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:
        pass
    return int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))


_current: "weakref.ref[Session] | None" = None
_NO_SESSION = None


def _remember(session: Session) -> Session:
    global _current
    _current = weakref.ref(session)
    return session


def _auto_session() -> Session | None:
    """The live session auto-instrumentation opened in this process, if any."""
    session = _current() if _current is not None else None
    if session is not None and session.enabled and session.step_source == "optimizer hooks" \
            and not session._manual_steps:
        return session
    return None


def current() -> Session:
    """The session this process's last `init()` returned, or a no-op one: for libraries that report to the
    agent without being handed the session (the Checkpointer)."""
    global _NO_SESSION
    session = _current() if _current is not None else None
    if session is None:
        if _NO_SESSION is None:
            _NO_SESSION = Session(job="default", rank=0, world_size=1, client_config=None)
        session = _NO_SESSION
    return session


_exit_reason: str | None = None
_live: "weakref.WeakSet[Session]" = weakref.WeakSet()
_ABANDONED_IN_CHILD: list = []


def _after_fork_in_child() -> None:
    for session in list(_live):
        session._detach_in_forked_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def goodbye(reason: str, timeout: float = 1.0) -> None:
    """Close every telemetry session of this process with `reason` (best effort, within `timeout` each).
    For training loops that leave with ``os._exit`` after a failure, which skips the exit hooks: the
    agent then knows this rank left on purpose and why, unlike a rank killed by a signal. Start the
    reason with ``"peer gone: "`` when leaving because another rank failed (a collective with it broke):
    crash incidents then look past this rank for the one that failed first."""
    for session in list(_live):
        try:
            session.close(reason=reason[:200], timeout=timeout)
        except Exception:
            pass


def _watch_exit(session: Session) -> None:
    """Say goodbye, with the reason, when the worker exits without closing the session: an uncaught
    exception (recorded by an excepthook that then defers to the previous one) or a plain return. The
    agent tells a worker that left this way from one killed by a signal, which cannot say anything:
    that is how a crash incident names the rank that died first rather than the peers it took down."""
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        global _exit_reason
        _exit_reason = f"exception: {kind.__name__}: {value}"[:200]
        previous(kind, value, tb)

    _live.add(session)
    if not getattr(sys.excepthook, "_trainwarden", False):
        excepthook._trainwarden = True  # type: ignore[attr-defined]
        sys.excepthook = excepthook
    atexit.register(lambda: session.close(reason=_exit_reason or "exit", timeout=1.0))

"""trainwarden's torchrun: torch's launcher and elastic agent, reporting what happens to the workers as
structured events instead of log lines.

``trainwarden run`` starts ``python -m trainwarden.agent.launch.elastic [--warm-zygote] <torchrun arguments>``
(``--warm-zygote``: start the warm workers' zygote first, ``WARM_ZYGOTE_FLAG``), which is
``torch.distributed.run.main`` with every flag and behaviour of torchrun, plus one thing: the elastic agent
is ``ReportingElasticAgent``, a ``LocalElasticAgent`` that writes one JSON line per event to the pipe whose
descriptor is in ``TRAINWARDEN_LAUNCH_EVENTS_FD``:

- ``started``: a worker round began (after the rendezvous): its restart count, world size, every local
  worker's global rank and pid, and ``spare_swap``: whether a hot spare took a lost node's place in it (the native
  round's handler says so);
- ``failed``: the round failed: per failed worker its global and local rank, pid, exit code (a negative
  code is the signal that killed it) and the message of its error file when it wrote one
  (``torch.distributed.elastic.multiprocessing.errors.record``), with the time of the failure and each
  worker's exit time to the millisecond (``exited_at``, agent/launch/exit_clock.py: the exit order);
- ``membership_pending``: nodes are waiting to join a healthy round (the job grows). With a reply pipe
  (``TRAINWARDEN_LAUNCH_REPLY_FD``) the agent then waits, at most GROW_WAIT_S, for the supervisor's line
  ``go``: meanwhile the supervisor has every worker save a checkpoint at one agreed step and hold there,
  so the restart that follows loses no step (agent/launch/regroup.py, ``Regrouping.before_growing``);
  A worker that exits with ``EXIT_RESUME_BLOCKED`` (its job's checkpoints cannot be read or loaded) or
  ``EXIT_NUMERIC_STOP`` (its numeric policy stops the job on NaN) ends
  the run: no restart, none spent (``restarts_left`` in the event is 0);
- ``restarting``: the agent restarts the group, after a failure (``reason: failed``, with the restarts
  left), because nodes are waiting to join (``reason: membership``), or because the supervisor wrote
  ``restart <round>`` on the reply pipe for the current rendezvous round (``reason: regroup``: a node left the job after every worker saved and
  held at one step, agent/launch/regroup.py ``Regrouping._on_leave``), which counts no failure;
- ``waiting``: the rendezvous round closed without this node, which waits in the next (a hot spare, or a node
  that came after the round closed), with that round's number;
- ``finished``: the agent's final state (``SUCCEEDED`` or ``FAILED``); a node that waited as a hot spare until the
  job ended (its rendezvous closed: ``RendezvousGracefulExitError``) finishes ``SUCCEEDED``, and so does a node
  that restarted its workers after another node's had finished the job (the closed key says so).

The supervisor decides phases, restarts and crash attribution from these and from the workers' telemetry;
it never reads torchrun's wording (agent/launch/run.py).

The agent also acts on a worker's exit the moment it happens: torch's loop polls every ``--monitor-interval``
(0.25 s here), so a crash or an aborted round waited half of that on average before the restart began. The
loop now only ticks, and each poll first waits, at most the interval, for the exit clock to see an exit.

How the agent is substituted: ``launch_agent`` (torch.distributed.launcher.api) constructs
``LocalElasticAgent`` by its module-level name; ``main`` binds that one name to the subclass before handing
over to torchrun. This is the only place trainwarden replaces anything of torch's, and the launch tests
(tests/integration/test_launch_events.py) run it against the installed torch. Without the variable (plain
use of this module) nothing is replaced. Writing an event never fails the agent: a closed pipe (the
supervisor died) is noted once and further events are dropped.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from trainwarden.agent.launch.exit_clock import ExitClock
from trainwarden.agent.shared.contract import (EXIT_NUMERIC_STOP, EXIT_RESUME_BLOCKED, WARM_MAP_DIR_ENV, WARM_SOCKET_ENV,
                                              WARM_PARENT_PID_ENV, WARM_ZYGOTE_PID_ENV, ZYGOTE_MODULE)
from trainwarden.agent.shared.parent_death import LAUNCHER_PID_ENV, SUPERVISOR_PID_ENV, die_with_parent

__all__ = ["EVENTS_FD_ENV", "EventSink", "GROW_WAIT_S", "REPLY_FD_ENV", "ReplyChannel", "WARM_ZYGOTE_FLAG", "main",
           "own_options", "reporting_agent_class"]

log = logging.getLogger(__name__)

EVENTS_FD_ENV = "TRAINWARDEN_LAUNCH_EVENTS_FD"
REPLY_FD_ENV = "TRAINWARDEN_LAUNCH_REPLY_FD"
WARM_ZYGOTE_FLAG = "--warm-zygote"
"""This module's own option, first in its argv (taken off before torchrun's): start the warm workers' zygote
(``_start_zygote``). ``torchrun_command`` gives it with a warm directory; nothing is read from the script's name."""
_LOOP_TICK_S = 0.001
"""torch's monitor loop sleeps this between polls; ``_monitor_workers`` does the waiting (for a worker's exit,
or ``--monitor-interval`` at most)."""
GROW_WAIT_S = 150.0
"""The longest the agent waits for the supervisor before a membership restart. Past it the group restarts
anyway, from the latest checkpoint there is (the steps since are replayed, as torchrun would)."""


class ReplyChannel:
    """The supervisor's answers on a file descriptor, one word a line (``go``, ``restart``); never raises."""

    def __init__(self, fd: int) -> None:
        os.set_inheritable(fd, False)
        self._fd = fd
        self._partial = b""
        self._lines: list[str] = []
        self._closed = False

    def _read(self, timeout: float) -> None:
        import select

        if self._closed:
            return
        try:
            ready, _, _ = select.select([self._fd], [], [], max(0.0, timeout))
            if not ready:
                return
            chunk = os.read(self._fd, 4096)
        except OSError:
            chunk = b""
        if not chunk:
            self._closed = True
            return
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        self._lines += [line.strip().decode(errors="replace") for line in lines if line.strip()]

    def _take(self, word: str) -> bool:
        if word in self._lines:
            self._lines.remove(word)
            return True
        return False

    def wait_for(self, word: str, timeout: float) -> bool:
        """True once a line equal to ``word`` arrived within ``timeout`` seconds; False on timeout or EOF."""
        deadline = time.monotonic() + timeout
        while not self._take(word):
            left = deadline - time.monotonic()
            if left <= 0 or self._closed:
                return False
            self._read(left)
        return True

    def poll(self, word: str, round_: int | None = None) -> bool:
        """True when a line ``word`` (with ``round_``: ``word <round_>``) has arrived (never waits). Lines of
        ``word`` for other rounds are stale (the group has regrouped since) and dropped."""
        self._read(0.0)
        if round_ is None:
            return self._take(word)
        found = False
        for line in [line for line in self._lines if line.split(" ")[0] == word]:
            self._lines.remove(line)
            found = found or line == f"{word} {round_}"
        return found


class EventSink:
    """Writes JSON lines to a file descriptor; never raises."""

    def __init__(self, fd: int) -> None:
        os.set_inheritable(fd, False)  # workers must not hold the supervisor's pipe open
        self._file = os.fdopen(fd, "w", buffering=1)
        self._lock = threading.Lock()
        self._broken = False

    def emit(self, event: str, **fields: Any) -> None:
        if self._broken:
            return
        line = json.dumps({"event": event, "t": time.time(), **fields}, default=str)
        with self._lock:
            try:
                self._file.write(line + "\n")
                self._file.flush()
            except (OSError, ValueError) as exc:
                self._broken = True
                log.warning("trainwarden: cannot report launch events any more (%s); the job goes on", exc)


def reporting_agent_class(sink: EventSink, replies: ReplyChannel | None = None):
    """A ``LocalElasticAgent`` subclass that reports to ``sink`` (see the module docstring)."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    exits = ExitClock()

    class ReportingElasticAgent(LocalElasticAgent):
        _reported_failure = False

        def _restart_count(self) -> int:
            return self._worker_group.spec.max_restarts - self._remaining_restarts

        def _start_workers(self, worker_group):
            pids = super()._start_workers(worker_group)
            exits.watch(pid for pid in pids.values() if pid)
            self._reported_failure = False
            sink.emit("started", **_started(worker_group, pids, self._restart_count()))
            return pids

        _asked_restart = False
        _wait_s = 0.1

        def _rendezvous(self, worker_group):
            handler = worker_group.spec.rdzv_handler
            if hasattr(handler, "on_wait"):  # the native round: a node the round left out waits (a spare)
                handler.on_wait = lambda round_: sink.emit("waiting", round=round_)
            return super()._rendezvous(worker_group)

        def _monitor_workers(self, worker_group):
            exits.wait_for_exit(self._wait_s)  # torch's loop only ticks (see run): a worker's exit wakes it now
            if replies is not None and replies.poll("restart", _rendezvous_round(worker_group)):  # a node left
                self._regroup(worker_group)
            result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and not self._reported_failure:
                self._reported_failure = True
                if any(f.exitcode in (EXIT_RESUME_BLOCKED, EXIT_NUMERIC_STOP) for f in result.failures.values()):
                    self._remaining_restarts = 0  # a restart would meet the same checkpoints: stop, spend nothing
                sink.emit("failed", restart_count=self._restart_count(), state=result.state.name,
                          restarts_left=self._remaining_restarts, failures=_failure_records(result, exits))
            return result

        def _regroup(self, worker_group) -> None:
            """The supervisor asked for a restart into a new round (a node left at an agreed step): restart a
            healthy group without counting a failure."""
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.HEALTHY:
                self._asked_restart = True
                sink.emit("restarting", reason="regroup", restart_count=self._restart_count(),
                          restarts_left=self._remaining_restarts)
                super()._restart_workers(worker_group)  # no failure counted: the group was healthy
                self._asked_restart = False

        def _restart_workers(self, worker_group):
            if not self._reported_failure and replies is not None:  # a healthy round that nodes wait to join
                _await_checkpoint_for_membership(worker_group, sink, replies, self._restart_count())
            sink.emit("restarting", reason="failed" if self._reported_failure else "membership",
                      restart_count=self._restart_count(), restarts_left=self._remaining_restarts)
            super()._restart_workers(worker_group)

        def run(self, role: str = "default"):
            # torch's loop sleeps ``monitor_interval`` between polls: on average half of it between a worker's
            # exit and the restart. The loop ticks instead, and each poll waits up to the interval for an exit.
            spec = self._worker_group.spec
            self._wait_s, spec.monitor_interval = spec.monitor_interval, _LOOP_TICK_S
            result = None
            try:
                result = super().run(role)
                if result is None:  # RendezvousGracefulExitError: the job ended while this node waited (a spare)
                    from torch.distributed.elastic.agent.server.api import RunResult

                    result = RunResult(state=WorkerState.SUCCEEDED)
                return result
            finally:
                state = result.state.name if result is not None else "FAILED"
                if hasattr(spec.rdzv_handler, "job_outcome"):  # the native round's closed key says it
                    spec.rdzv_handler.job_outcome = state
                sink.emit("finished", state=state, restart_count=self._restart_count())

    return ReportingElasticAgent


def _started(worker_group, pids: dict, restart_count: int) -> dict:
    """The ``started`` event's fields: the round, this node's place in it, and each worker's ranks and pid."""
    return dict(restart_count=restart_count, group_rank=worker_group.group_rank,
                group_world_size=worker_group.group_world_size, round=_rendezvous_round(worker_group),
                spare_swap=bool(getattr(worker_group.spec.rdzv_handler, "spare_swap", False)),
                workers=[{"local_rank": w.local_rank, "global_rank": w.global_rank, "pid": pids.get(w.local_rank)}
                         for w in worker_group.workers])


def _await_checkpoint_for_membership(worker_group, sink: EventSink, replies: ReplyChannel, restart_count: int) -> None:
    """Before a membership restart of a healthy group: say so, and wait (at most ``GROW_WAIT_S``) for the supervisor's
    ``go``, sent once a checkpoint of the agreed step is committed."""
    sink.emit("membership_pending", round=_rendezvous_round(worker_group), restart_count=restart_count)
    if not replies.wait_for("go", GROW_WAIT_S):
        log.warning("trainwarden: no checkpoint before the membership change within %.0f s; restarting from the "
                    "latest checkpoint there is", GROW_WAIT_S)


def _failure_records(result, exits: ExitClock) -> list[dict]:
    """What the ``failed`` event says of each failed worker: who, how it exited, when, and its error file's word."""
    return [{"global_rank": rank, "local_rank": f.local_rank, "pid": f.pid, "exitcode": f.exitcode,
             "at": f.timestamp, "exited_at": exits.exited_at(f.pid),
             "message": _error_message(f) if os.path.isfile(f.error_file or "") else ""}
            for rank, f in sorted(result.failures.items())]


def _rendezvous_round(worker_group) -> int | None:
    """The rendezvous round the group's workers belong to (the same on every node): the etcd-native handler's
    ``round_number``, or torch's dynamic handler's state; None for another handler."""
    handler = worker_group.spec.rdzv_handler
    round_ = getattr(handler, "round_number", None)
    if round_ is None:
        state = getattr(getattr(handler, "_state_holder", None), "state", None)
        round_ = getattr(state, "round", None)
    return int(round_) if isinstance(round_, int) else None


def _error_message(failure) -> str:
    """The message of a worker's error file: a string, or torch's ``{"message": ..., "extraInfo": ...}``."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message)[:2000]


def main(argv: list[str] | None = None) -> None:
    """torchrun's ``main`` with the reporting agent when ``TRAINWARDEN_LAUNCH_EVENTS_FD`` names a pipe."""
    supervisor = os.environ.pop(SUPERVISOR_PID_ENV, None)
    if supervisor:  # trainwarden run killed hard: SIGTERM makes torchrun stop its workers before it goes
        die_with_parent(signal.SIGTERM, int(supervisor))
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # and the workers that can, die with this process
    fd = os.environ.pop(EVENTS_FD_ENV, None)
    reply_fd = os.environ.pop(REPLY_FD_ENV, None)
    argv = sys.argv[1:] if argv is None else argv
    warm, argv = own_options(argv)
    # the zygote first: its imports (torch's among them) then run beside this process's own import of torch,
    # which otherwise came first and delayed every launch's first workers by one whole import
    zygote = _start_zygote(argv) if warm else None
    try:
        from torch.distributed import run as torchrun
        from torch.distributed.launcher import api as launcher_api

        if fd:
            replies = ReplyChannel(int(reply_fd)) if reply_fd else None
            launcher_api.LocalElasticAgent = reporting_agent_class(EventSink(int(fd)), replies)
        torchrun.main(argv)
    finally:
        if zygote is not None:
            zygote.terminate()  # its workers die with it (PR_SET_PDEATHSIG)
            try:
                zygote.wait(10)
            except Exception:
                zygote.kill()


def own_options(argv: list[str]) -> tuple[bool, list[str]]:
    """This module's own option (``WARM_ZYGOTE_FLAG``, first when given) and torchrun's arguments after it."""
    return (True, argv[1:]) if argv[:1] == [WARM_ZYGOTE_FLAG] else (False, list(argv))


def _start_zygote(argv: list[str]):
    """The process warm workers fork from (runtime/zygote.py), started here, from the main thread and before torch's
    agent starts any thread (its parent-death signal follows the thread that started it). Asked for by
    ``WARM_ZYGOTE_FLAG``; torchrun's script is then the zygote's client, ``-m ZYGOTE_MODULE SCRIPT...``
    (``torchrun_command``), and SCRIPT is what the zygote prepares for."""
    import subprocess

    path, map_dir = os.environ.get(WARM_SOCKET_ENV), os.environ.get(WARM_MAP_DIR_ENV)
    script = _warm_script(argv)
    if not path or not map_dir or script is None:
        raise SystemExit(f"trainwarden: {WARM_ZYGOTE_FLAG} needs {WARM_SOCKET_ENV} and {WARM_MAP_DIR_ENV} in the "
                         f"environment and '-m {ZYGOTE_MODULE} SCRIPT...' as torchrun's script; start warm workers "
                         "with `trainwarden run --warm-workers`, which sets both")
    zygote = subprocess.Popen([sys.executable, "-m", ZYGOTE_MODULE, "--serve", path, map_dir, *script],
                              env={**os.environ, WARM_PARENT_PID_ENV: str(os.getpid())})
    os.environ[WARM_ZYGOTE_PID_ENV] = str(zygote.pid)  # torch's agent passes it on: clients wait only while it lives
    return zygote


def _warm_script(argv: list[str]) -> list[str] | None:
    """The script after torchrun's ``-m ZYGOTE_MODULE`` (the client as torchrun's script), None without one."""
    for i in range(len(argv) - 1):
        if argv[i] in ("-m", "--module") and argv[i + 1] == ZYGOTE_MODULE:
            return argv[i + 2:]
    return None


if __name__ == "__main__":
    from trainwarden.agent.common.process_exit import exit_now

    try:
        main()
    except SystemExit as exit_:  # torchrun's own exits (argument errors, ``sys.exit(code)``): the same code
        if not isinstance(exit_.code, (int, type(None))):
            raise
        exit_now(exit_.code)
    exit_now(0)  # torch's finalization took 1.5 to 2 s after every launch (agent/common/process_exit.py)

"""trainwarden's torchrun: torch's launcher and elastic agent, reporting what happens to the workers as
structured events instead of log lines.

``trainwarden run`` starts ``python -m trainwarden.agent.launch.elastic <torchrun arguments>``, which is
``torch.distributed.run.main`` with every flag and behaviour of torchrun, plus one thing: the elastic agent
is ``ReportingElasticAgent``, a ``LocalElasticAgent`` that writes one JSON line per event to the pipe whose
descriptor is in ``TRAINWARDEN_LAUNCH_EVENTS_FD``:

- ``started``: a worker round began (after the rendezvous): its restart count, world size, and every local
  worker's global rank and pid;
- ``failed``: the round failed: per failed worker its global and local rank, pid, exit code (a negative
  code is the signal that killed it) and the message of its error file when it wrote one
  (``torch.distributed.elastic.multiprocessing.errors.record``), with the time of the failure;
- ``restarting``: the agent restarts the group, after a failure (``reason: failed``, with the restarts
  left) or because nodes are waiting to join (``reason: membership``);
- ``finished``: the agent's final state (``SUCCEEDED`` or ``FAILED``).

The supervisor decides phases, restarts and crash attribution from these and from the workers' telemetry;
it never reads torchrun's wording (agent/launch/run.py).

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

from trainwarden.agent.proto.parent_death import LAUNCHER_PID_ENV, SUPERVISOR_PID_ENV, die_with_parent

__all__ = ["EVENTS_FD_ENV", "EventSink", "main", "reporting_agent_class"]

log = logging.getLogger(__name__)

EVENTS_FD_ENV = "TRAINWARDEN_LAUNCH_EVENTS_FD"


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


def reporting_agent_class(sink: EventSink):
    """A ``LocalElasticAgent`` subclass that reports to ``sink`` (see the module docstring)."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class ReportingElasticAgent(LocalElasticAgent):
        _reported_failure = False

        def _restart_count(self) -> int:
            return self._worker_group.spec.max_restarts - self._remaining_restarts

        def _start_workers(self, worker_group):
            pids = super()._start_workers(worker_group)
            self._reported_failure = False
            sink.emit("started", restart_count=self._restart_count(), group_rank=worker_group.group_rank,
                      group_world_size=worker_group.group_world_size,
                      workers=[{"local_rank": w.local_rank, "global_rank": w.global_rank,
                                "pid": pids.get(w.local_rank)} for w in worker_group.workers])
            return pids

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and not self._reported_failure:
                self._reported_failure = True
                sink.emit("failed", restart_count=self._restart_count(), state=result.state.name,
                          restarts_left=self._remaining_restarts, failures=[
                              {"global_rank": rank, "local_rank": f.local_rank, "pid": f.pid,
                               "exitcode": f.exitcode, "at": f.timestamp,
                               "message": _error_message(f) if os.path.isfile(f.error_file or "") else ""}
                              for rank, f in sorted(result.failures.items())])
            return result

        def _restart_workers(self, worker_group):
            sink.emit("restarting", reason="failed" if self._reported_failure else "membership",
                      restart_count=self._restart_count(), restarts_left=self._remaining_restarts)
            super()._restart_workers(worker_group)

        def run(self, role: str = "default"):
            result = None
            try:
                result = super().run(role)
                return result
            finally:
                state = result.state.name if result is not None else "FAILED"
                sink.emit("finished", state=state, restart_count=self._restart_count())

    return ReportingElasticAgent


def _error_message(failure) -> str:
    """The message of a worker's error file: a string, or torch's ``{"message": ..., "extraInfo": ...}``."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message)[:2000]


def main(argv: list[str] | None = None) -> None:
    """torchrun's ``main`` with the reporting agent when ``TRAINWARDEN_LAUNCH_EVENTS_FD`` names a pipe."""
    from torch.distributed import run as torchrun
    from torch.distributed.launcher import api as launcher_api

    supervisor = os.environ.pop(SUPERVISOR_PID_ENV, None)
    if supervisor:  # trainwarden run killed hard: SIGTERM makes torchrun stop its workers before it goes
        die_with_parent(signal.SIGTERM, int(supervisor))
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # and the workers that can, die with this process
    fd = os.environ.pop(EVENTS_FD_ENV, None)
    if fd:
        launcher_api.LocalElasticAgent = reporting_agent_class(EventSink(int(fd)))
    torchrun.main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()

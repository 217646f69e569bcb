"""One start of torchrun by `trainwarden run`, with the pipes and threads that serve it: ``close()`` releases them all.

A launch is torchrun's process (agent/launch/process.py), its output pumped to the terminal and the run log
(agent/launch/output.py), its structured events read from one pipe (agent/launch/events.py) and our answers
written to another (``go``, ``restart <round>``: agent/launch/elastic.py). A node fenced from etcd launches again in
the same run (agent/launch/run.py), so a launch must give back what it held when it is over, not when the run
ends: each one used to keep a handle on the run log, the reply pipe's end and torchrun's output pipe until then,
3 fds a fence (the daemon soak's hour, session 36: one `trainwarden run` went from 24 to 31 fds; session 37 found
which, on the bed, with `/proc/<pid>/fd` after three partitions).
"""

from __future__ import annotations

import logging
import os
import subprocess
from typing import Callable, TextIO

from trainwarden.agent.launch.elastic import EVENTS_FD_ENV, REPLY_FD_ENV
from trainwarden.agent.launch.events import LaunchEventReader
from trainwarden.agent.launch.output import OutputPump
from trainwarden.agent.launch.process import TorchrunProcess

logger = logging.getLogger(__name__)

__all__ = ["Launched"]


class Launched:
    """torchrun started with ``cmd`` and ``env`` (module docstring). Its output goes to ``out`` and ``log`` from
    ``start_reading()`` on, each line to ``on_line``, each event to ``on_event``. Raises ``OSError`` when torchrun
    cannot be started, having closed what it opened."""

    def __init__(self, cmd: list[str], env: dict[str, str], *, out: TextIO, log: TextIO,
                 on_line: Callable[[str], None], on_event: Callable[[dict], None]) -> None:
        events_read, events_write = os.pipe()  # the launcher's structured events
        reply_read, reply_write = os.pipe()  # and our answers to it
        try:
            self.torchrun = TorchrunProcess(cmd, {**env, EVENTS_FD_ENV: str(events_write), REPLY_FD_ENV: str(reply_read)},
                                            stdout=subprocess.PIPE, pass_fds=(events_write, reply_read))
        except OSError:
            os.close(events_read)
            os.close(reply_write)
            raise
        finally:
            os.close(events_write)
            os.close(reply_read)
        self._reply_fd: int | None = reply_write
        self._events_fd: int | None = events_read  # the reader's from ``start_reading`` on (it closes it at the end)
        self.events = LaunchEventReader(events_read, on_event)
        self.pump = OutputPump(self.torchrun.stdout, out, log, on_line)

    def start_reading(self) -> None:
        self._events_fd = None
        self.events.start()
        self.pump.start()

    def reply(self, line: bytes) -> None:
        """Answer torchrun on its reply pipe; nothing when it is gone or the launch is closed."""
        try:
            os.write(self._reply_fd, line)
        except (OSError, TypeError):
            pass  # torchrun is gone: nothing waits for us

    def stop(self, grace: float = 10.0) -> None:
        """Stop torchrun and its workers, its output and events read to the end (its shutdown goes to the log only)."""
        self.pump.quiet = True
        self.torchrun.stop(grace=grace)
        self.join()

    def join(self, output_s: float = 5.0, events_s: float = 5.0) -> None:
        for thread, timeout in ((self.pump, output_s), (self.events, events_s)):
            if thread.is_alive():
                thread.join(timeout)

    def close(self) -> None:
        """Stop torchrun if it still runs and give back every fd this launch holds; idempotent."""
        self.torchrun.stop()
        self.join()
        for fd in (self._reply_fd, self._events_fd):
            if fd is not None:
                os.close(fd)
        self._reply_fd = self._events_fd = None
        stdout = self.torchrun.stdout
        if stdout is not None and not stdout.closed:
            if self.pump.is_alive():  # a descendant still holds torchrun's output open: closing would race its read
                logger.warning("torchrun pid %d's output is still open after it ended; leaving its pipe to the "
                               "run's end", self.torchrun.pid)
            else:
                stdout.close()

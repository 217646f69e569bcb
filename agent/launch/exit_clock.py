"""When each worker process exited, to the millisecond, for any script.

torchrun notices failed workers by polling and stamps them all with one whole second, so its report
cannot say which rank left first. ``ExitClock`` watches the workers' pidfds (Linux 5.3+) from a thread of
the launcher and stamps each exit as it happens; crash attribution (agent/incidents/first_failure.py)
then knows the exit order even of a script that sends no telemetry and writes no error file. An exit
it could not watch (no pidfd support, a process already gone) has no time, never a guessed one.

The same wake-up tells the launcher's monitor loop that a worker exited (``wait_for_exit``), so a crash or
an aborted round is seen the moment it happens instead of at torch's next poll (agent/launch/elastic.py).
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from typing import Callable, Iterable

__all__ = ["ExitClock"]

log = logging.getLogger(__name__)


class ExitClock:
    """Wall time of each watched process's exit; ``watch`` replaces the watched set (one worker round)."""

    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self._wall = wall
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}       # pidfd -> pid
        self._exited: dict[int, float] = {}  # pid -> wall time
        self._wake_r, self._wake_w = os.pipe()
        self._stopped = False
        self._an_exit = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainwarden-exit-clock", daemon=True)
        self._thread.start()

    def watch(self, pids: Iterable[int]) -> None:
        """Watch these processes from now on (the previous round's are let go)."""
        fds = {}
        for pid in pids:
            try:
                fds[os.pidfd_open(int(pid))] = int(pid)
            except (OSError, AttributeError) as exc:  # gone already, or no pidfd on this kernel
                log.debug("cannot watch the exit of pid %s: %s", pid, exc)
        with self._lock:
            old, self._fds = self._fds, fds
        for fd in old:
            os.close(fd)
        os.write(self._wake_w, b"w")

    def exited_at(self, pid: int) -> float | None:
        with self._lock:
            return self._exited.get(int(pid))

    def wait_for_exit(self, timeout: float) -> bool:
        """Block until a watched process exits or ``timeout`` passes; whether one exited (once per exit
        seen: the next call waits for the next one)."""
        seen = self._an_exit.wait(timeout)
        self._an_exit.clear()
        return seen

    def close(self) -> None:
        self._stopped = True
        os.write(self._wake_w, b"q")
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stopped:
            try:
                self._wait_once()
            except Exception:  # never take the launcher down: exit times are evidence only
                log.exception("exit clock: one wait failed; going on")

    def _wait_once(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        with self._lock:
            watched = dict(self._fds)
        for fd in watched:
            poller.register(fd, select.POLLIN)
        for fd, _ in poller.poll():
            if fd == self._wake_r:
                os.read(self._wake_r, 64)
                continue
            now = self._wall()
            with self._lock:
                pid = self._fds.pop(fd, None)
                if pid is not None:
                    self._exited[pid] = now
                    os.close(fd)
            self._an_exit.set()

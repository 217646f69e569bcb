"""Watching a launcher's worker processes from outside: when each one started and when it was gone.

``WorkerWatch`` is a thread that follows the direct children of one launcher process (torchrun's elastic agent:
its workers) below a root process the benchmark started. Every ``poll_s`` it checks the workers it knows (one
small read of ``/proc/<pid>/stat`` each) and notes the first poll at which one has exited or is a zombie
(exited, not yet reaped by the agent); every ``scan_s`` it looks for new children (a scan of every process's
``stat``, the costly part, hence less often). A worker's start time comes from its ``stat`` (clock ticks since
boot), not from when the scan found it, so a slow scan does not delay it.

Why not psutil's ``create_time``: it adds the start ticks to ``/proc/stat``'s ``btime``, which is whole seconds,
so on Linux its answers are off by up to a second against ``time.time()`` (measured 0.86 s on the bench
machine). Here the boot time is ``time.time() - clock_gettime(CLOCK_BOOTTIME)``, the clock the kernel counts
start times in, so start times are exact to a clock tick (10 ms).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["Worker", "WorkerWatch"]

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass
class Worker:
    """One child of the launcher: its start (wall clock, from /proc) and when the watch saw it gone."""

    pid: int
    started: float
    gone: float | None = None
    ticks: int = 0
    """Start in clock ticks since boot: with the pid, it names the process (pids are reused)."""


def _stat(proc: Path, pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start ticks since boot) of ``pid``, or None once it is gone."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()  # the command name, in parentheses, may hold spaces
    return fields[0], int(fields[1]), int(fields[19])


def _cmdline(proc: Path, pid: int) -> list[str]:
    try:
        return (proc / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


class WorkerWatch(threading.Thread):
    """Follows the children of the launcher below ``root`` (see the module docstring).

    ``is_launcher(cmdline)`` picks the launcher among ``root`` and its descendants (``root`` itself for plain
    torchrun; the ``trainwarden.agent.launch.elastic`` child for `trainwarden run`).
    """

    def __init__(self, root: int, is_launcher: Callable[[list[str]], bool], *, poll_s: float = 0.02,
                 scan_s: float = 0.25, proc: Path = Path("/proc"), wall=time.time,
                 boottime=lambda: time.clock_gettime(time.CLOCK_BOOTTIME)) -> None:
        super().__init__(name="bench-worker-watch", daemon=True)
        self._root, self._is_launcher = root, is_launcher
        self._poll_s, self._scan_s = poll_s, scan_s
        self._proc, self._wall, self._boottime = proc, wall, boottime
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._workers: dict[int, Worker] = {}
        self.launcher: int | None = None
        self.error: BaseException | None = None

    def workers(self) -> list[Worker]:
        """Every worker seen so far, by start time."""
        with self._lock:
            return sorted((Worker(w.pid, w.started, w.gone, w.ticks) for w in self._workers.values()),
                          key=lambda w: w.started)

    def stop(self) -> None:
        self._done.set()
        self.join(5)

    def kill_leftovers(self) -> list[int]:
        """SIGKILL every worker seen that still runs (the launcher was killed before it could stop them: torchrun
        starts each worker in a session of its own, out of reach of a kill of the launcher's group); their pids."""
        killed = []
        for worker in self.workers():
            stat = _stat(self._proc, worker.pid)
            if stat is not None and stat[2] == worker.ticks and stat[0] not in ("Z", "X"):
                try:
                    os.kill(worker.pid, signal.SIGKILL)
                    killed.append(worker.pid)
                except ProcessLookupError:
                    pass
        return killed

    def run(self) -> None:
        next_scan = 0.0
        while not self._done.is_set():
            try:
                now = time.monotonic()
                if now >= next_scan:
                    self._scan()
                    next_scan = now + self._scan_s
                self._check()
            except Exception as exc:  # keep watching; the benchmark reports what went wrong at the end
                self.error = exc
            self._done.wait(self._poll_s)

    def _check(self) -> None:
        with self._lock:
            alive = [w for w in self._workers.values() if w.gone is None]
        for worker in alive:
            if "--serve" in _cmdline(self._proc, worker.pid):  # the zygote, seen before its exec: no worker
                with self._lock:
                    self._workers.pop(worker.pid, None)
                continue
            stat = _stat(self._proc, worker.pid)
            if stat is None or stat[0] in ("Z", "X") or stat[1] != self.launcher:
                worker.gone = self._wall()

    def _scan(self) -> None:
        parents = {}
        for entry in self._proc.iterdir():
            if entry.name.isdigit():
                stat = _stat(self._proc, int(entry.name))
                if stat is not None:
                    parents[int(entry.name)] = stat
        if self.launcher is None:
            self.launcher = self._find_launcher(parents)
            if self.launcher is None:
                return
        boot = self._wall() - self._boottime()
        with self._lock:
            for pid, (state, ppid, ticks) in parents.items():
                if ppid == self.launcher and pid not in self._workers and state not in ("Z", "X"):
                    if "--serve" in _cmdline(self._proc, pid):  # the warm workers' zygote is no worker
                        continue
                    self._workers[pid] = Worker(pid, boot + ticks / _TICKS_PER_S, ticks=ticks)

    def _find_launcher(self, parents: dict[int, tuple[str, int, int]]) -> int | None:
        family, frontier = [], [self._root]
        while frontier:  # root first, then its descendants breadth first
            family += frontier
            frontier = [pid for pid, (_, ppid, _) in parents.items() if ppid in frontier]
        return next((pid for pid in family if self._is_launcher(_cmdline(self._proc, pid))), None)

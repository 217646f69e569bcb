"""The running torchrun and every process it started; ``TorchrunProcess.stop()`` leaves none of them behind.

``TorchrunProcess`` owns the running torchrun. torchrun starts every worker in a session of its own,
so killing torchrun's process group does not reach them; and a torchrun killed hard leaves orphans.
So the supervisor keeps a list of torchrun's descendants (refreshed while it runs) and, on stop,
signals torchrun first (it stops its workers itself), then kills whatever it started that is still
there, by pid and start time, never anything else.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time

import psutil

logger = logging.getLogger(__name__)

__all__ = ["TorchrunProcess"]


class TorchrunProcess:
    """A running torchrun and every process it started; ``stop()`` leaves none of them behind."""

    def __init__(self, cmd: list[str], env: dict[str, str], *, stdout=None, cwd: str | None = None,
                 pass_fds: tuple[int, ...] = ()) -> None:
        self.cmd = cmd
        self._proc = subprocess.Popen(
            cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=stdout,
            stderr=subprocess.STDOUT if stdout is not None else None,
            start_new_session=True, pass_fds=pass_fds,
        )
        self._known: dict[int, float] = {}  # pid -> create_time of every descendant seen
        logger.info("started torchrun pid=%d: %s", self._proc.pid, " ".join(cmd))

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def stdout(self):
        return self._proc.stdout

    def poll(self) -> int | None:
        self.refresh()
        return self._proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._proc.wait(timeout)

    def refresh(self) -> None:
        """Remember torchrun's current descendants (workers come and go with restarts)."""
        try:
            children = psutil.Process(self._proc.pid).children(recursive=True)
        except psutil.Error:
            return
        for child in children:
            try:
                self._known.setdefault(child.pid, child.create_time())
            except psutil.Error:
                continue

    def _survivors(self) -> list[psutil.Process]:
        alive = []
        for pid, created in self._known.items():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.Error:
                continue
        return alive

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM torchrun (it stops its workers), then SIGKILL whatever it started that remains."""
        self.refresh()
        if self._proc.poll() is None:
            logger.info("stopping torchrun pid=%d", self._proc.pid)
            self._signal_group(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(grace)
            except subprocess.TimeoutExpired:
                logger.warning("torchrun did not stop within %.0fs; killing it", grace)
        self._signal_group(self._proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + grace
        survivors = self._survivors()
        for proc in survivors:
            self._kill_tree(proc)
        while survivors and time.monotonic() < deadline:
            survivors = self._survivors()
            time.sleep(0.05)
        if survivors:
            logger.error("processes still alive after stop: %s", [p.pid for p in survivors])
        try:
            return self._proc.wait(5)
        except subprocess.TimeoutExpired:
            return None

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _kill_tree(self, proc: psutil.Process) -> None:
        try:
            pgid = os.getpgid(proc.pid)
        except ProcessLookupError:
            return
        # a worker leads its own session (torchrun starts it so): kill its group, which holds its children
        if pgid == proc.pid:
            self._signal_group(pgid, signal.SIGCONT)
            self._signal_group(pgid, signal.SIGKILL)
        else:
            try:
                proc.kill()
            except psutil.Error:
                pass

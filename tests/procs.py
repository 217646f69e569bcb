"""Process helpers for tests: every child runs in its own session and is killed as a group."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


class ProcessGroup:
    """Starts children in their own sessions and kills every group it started on ``close()``."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen] = []

    def spawn(self, cmd: list[str], *, log: Path, env: dict | None = None, cwd=None) -> subprocess.Popen:
        log.parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "ab")
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env=env, cwd=cwd, start_new_session=True,
        )
        out.close()
        proc.log_path = log  # type: ignore[attr-defined]
        self._procs.append(proc)
        return proc

    @staticmethod
    def kill(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    def _descendants(self) -> list:
        """Every live descendant of every child, by (pid, start time): torchrun starts each worker in a
        session of its own, so killing a child's process group does not reach them."""
        import psutil

        found = []
        for proc in self._procs:
            try:
                found += psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                continue
        return found

    def close(self) -> None:
        descendants = self._descendants()
        for proc in self._procs:
            if proc.poll() is None:
                self.kill(proc, signal.SIGTERM)
                self.kill(proc, signal.SIGCONT)  # a stopped group acts on SIGTERM only once continued
        deadline = time.monotonic() + 5
        for proc in self._procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        # the group may outlive its leader (workers of a killed torchrun): kill every group regardless
        for proc in self._procs:
            self.kill(proc, signal.SIGKILL)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for child in descendants:  # psutil refuses a pid that another process has taken since
            try:
                child.kill()
            except Exception:
                pass


def group_alive(pgid: int) -> list[int]:
    """Pids still in process group ``pgid`` (zombies excluded)."""
    import psutil

    alive = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return alive


def wait_for(predicate, timeout: float, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def stop_recorded_launchers(records) -> None:
    """Stop the launchers a node daemon started, from its records (``{"pid", "started"}``, the start time as psutil
    gives it): those run in sessions of their own by design, so no process group of a test reaches them. Only a
    pid whose start time still matches is ours; SIGTERM first (`trainwarden run` stops torchrun and its workers),
    SIGKILL to whatever of it is left after 30 s."""
    import psutil

    owned = []
    for rec in records:
        try:
            proc = psutil.Process(rec["pid"])
            if abs(proc.create_time() - rec["started"]) <= 0.01:
                owned.append((proc, proc.children(recursive=True)))
        except (KeyError, TypeError, psutil.Error):
            continue
    for proc, _ in owned:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    psutil.wait_procs([p for p, _ in owned], timeout=30)
    for proc, children in owned:
        for p in [proc, *children]:
            try:
                p.kill()
            except psutil.Error:
                pass

"""The record of what a `trainwarden run` started, so that no rerun ever trains beside its leftovers.

``<state_dir>/supervisor.json`` holds the supervisor (the `trainwarden run` process), the torchrun it
started, the embedded etcd and the workers of the current round, each as (pid, start time). It is written
when they start and removed when the run ends cleanly. A new run of the same job on this host reads it
first (``adopt_or_clear``):

- the supervisor still lives: the job is running here, and the new run is refused;
- the supervisor is gone (killed hard): every recorded process still alive with its recorded start time is
  a leftover of that run and is SIGKILLed (its process group too when it leads one, as torchrun's workers
  do), and the new run waits until they are gone; one that will not go is an error naming it.

Children normally die with their supervisor (agent/shared/parent_death.py); this is the second line, for
what the first could not reach (a script without the runtime whose torchrun was itself killed hard).
Only processes this record names by pid and start time are ever signalled.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

import psutil

from trainwarden.agent.common.process_identity import running_since
from trainwarden.agent.shared.atomic_file import atomic_write

logger = logging.getLogger(__name__)

__all__ = ["RECORD_NAME", "RunRecord", "RunRecordError"]

RECORD_NAME = "supervisor.json"


class RunRecordError(RuntimeError):
    """Another run of the job is alive here, or its leftovers would not stop. Not retryable as is."""


def _identity(pid: int) -> dict | None:
    try:
        return {"pid": pid, "started": psutil.Process(pid).create_time()}
    except psutil.Error:
        return None


def _alive(entry: dict) -> psutil.Process | None:
    try:
        pid = int(entry["pid"])
        started = running_since(pid)
        if started is not None and abs(started - float(entry["started"])) <= 0.01:
            return psutil.Process(pid)
    except (psutil.Error, KeyError, TypeError, ValueError):
        pass
    return None


class RunRecord:
    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / RECORD_NAME
        self._data: dict = {"supervisor": _identity(os.getpid()), "torchrun": None, "etcd": None, "workers": []}

    def adopt_or_clear(self, *, grace: float = 10.0) -> list[int]:
        """Refuse if the previous run lives; stop its leftovers if it does not. Returns the pids stopped."""
        try:
            previous = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            logger.warning("ignoring unreadable run record %s: %s", self.path, exc)
            return []
        supervisor = previous.get("supervisor") or {}
        if supervisor.get("pid") != os.getpid() and _alive(supervisor) is not None:
            raise RunRecordError(f"this job is already running here under trainwarden run pid {supervisor['pid']} "
                                 f"({self.path}); stop it first or choose another --job")
        entries = [e for e in [previous.get("torchrun"), previous.get("etcd"), *(previous.get("workers") or [])] if e]
        leftovers = [p for p in (_alive(e) for e in entries) if p is not None]
        for proc in leftovers:
            logger.warning("stopping pid %d (%s), left running by a trainwarden run of this job that was killed",
                           proc.pid, " ".join(proc.cmdline()[:3]) if _cmdline_ok(proc) else "?")
            try:
                if os.getpgid(proc.pid) == proc.pid:  # a worker leads its own group: its children go too
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.send_signal(signal.SIGKILL)  # psutil refuses a pid reused since it was checked
            except (ProcessLookupError, psutil.Error, PermissionError):
                pass
        deadline = time.monotonic() + grace
        while [p for p in leftovers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        stubborn = [p.pid for p in leftovers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if stubborn:
            raise RunRecordError(f"leftovers of a previous run of this job will not stop: pids {stubborn}")
        self.path.unlink(missing_ok=True)
        return [p.pid for p in leftovers]

    def set(self, role: str, pid: int) -> None:
        """Record the process with this role ("torchrun", "etcd") and write the record."""
        self._data[role] = _identity(pid)
        self._write()

    def set_workers(self, pids: list[int]) -> None:
        self._data["workers"] = [e for e in (_identity(p) for p in pids) if e]
        self._write()

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def _write(self) -> None:
        try:
            atomic_write(self.path, json.dumps(self._data, indent=1).encode())
        except OSError as exc:
            logger.warning("cannot write the run record %s: %s", self.path, exc)


def _cmdline_ok(proc: psutil.Process) -> bool:
    try:
        return bool(proc.cmdline())
    except psutil.Error:
        return False

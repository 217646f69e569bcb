"""Private temporary directories that outlive no run: ``scratch_dir`` makes one and marks it with its owner
(pid and process start time); ``sweep`` removes the marked ones whose owner is gone.

`trainwarden run` keeps its agent's socket and the warm workers' zygote socket in ``/tmp`` (a unix socket
path is limited to 107 bytes, which a state directory can exceed) and removes them when it ends. A run that
is SIGKILLed (an OOM kill, ``kill -9``, a node's power) cannot, so each run sweeps what dead runs left: a
directory is removed only when it has our prefix, belongs to this user, holds our owner mark, and that mark
names a process that no longer exists (a pid reused by another process has another start time; a zombie, killed
and not reaped yet, does not count). Directories without a mark are never touched.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import psutil

from trainwarden.agent.common.process_identity import running_since

__all__ = ["OWNER_FILE", "scratch_dir", "sweep"]

log = logging.getLogger(__name__)

OWNER_FILE = ".trainwarden-owner"
"""``<pid> <start time>`` of the process that made the directory."""


def _start_time(pid: int) -> float | None:
    """When ``pid`` started; None when it does not run (a zombie does not: killed, not reaped yet)."""
    try:
        return running_since(pid)
    except (psutil.Error, OSError):
        return None


def scratch_dir(prefix: str, *, root: str | os.PathLike | None = None) -> Path:
    """A new private (0700) directory ``<root>/<prefix>XXXX`` marked as this process's."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    pid = os.getpid()
    (path / OWNER_FILE).write_text(f"{pid} {_start_time(pid) or 0.0!r}\n")
    return path


def _owner_alive(mark: Path) -> bool:
    """Whether the process a mark names still runs (an unreadable or malformed mark counts as alive)."""
    try:
        pid_text, started_text = mark.read_text().split()
        pid, started = int(pid_text), float(started_text)
    except (OSError, ValueError):
        return True
    now_started = _start_time(pid)
    return now_started is not None and abs(now_started - started) < 1.0


def sweep(prefix: str, *, root: str | os.PathLike | None = None) -> list[Path]:
    """Remove this user's ``<root>/<prefix>*`` directories whose owner is gone; the ones removed."""
    base = Path(root if root is not None else tempfile.gettempdir())
    removed = []
    try:
        candidates = [p for p in base.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return removed
    uid = os.getuid()
    for path in candidates:
        try:
            if path.is_symlink() or not path.is_dir() or path.stat().st_uid != uid:
                continue
        except OSError:
            continue
        mark = path / OWNER_FILE
        if not mark.is_file() or _owner_alive(mark):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    if removed:
        log.info("removed %d directory(ies) a run that was killed left in %s: %s", len(removed), base,
                 ", ".join(p.name for p in removed))
    return removed

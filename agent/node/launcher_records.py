"""What the daemon knows of the launchers it started, kept on disk so that a new daemon adopts them.

One file per job, ``<state home>/daemon/launchers/<job>.json``: the launcher's pid and start time (together its
identity: a reused pid has another start time), the generation it runs and its log. A daemon that starts reads them
(`LauncherFiles.read_all`) and adopts each launcher that is still `alive`; the rest are removed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import psutil

from trainwarden.agent.common.process_identity import running_since
from trainwarden.agent.shared.atomic_file import atomic_write

logger = logging.getLogger(__name__)

__all__ = ["LauncherFiles", "LauncherRecord", "alive"]


@dataclass
class LauncherRecord:
    """What the daemon knows of one launcher it started (``<state home>/daemon/launchers/<job>.json``)."""

    job: str
    generation: int
    pid: int
    started: float
    """The process's start time (psutil ``create_time``): with the pid, the launcher's identity."""
    log: str
    relaunches: int = 0


class LauncherFiles:
    """The launcher records in `directory`, one ``<job>.json`` each, written atomically."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def save(self, rec: LauncherRecord) -> None:
        atomic_write(self._path(rec.job), json.dumps(asdict(rec), indent=1).encode())

    def forget(self, job: str) -> None:
        self._path(job).unlink(missing_ok=True)

    def read_all(self) -> Iterator[LauncherRecord]:
        """Every readable record, by job name; an unreadable file is logged and left."""
        for path in sorted(self.directory.glob("*.json")):
            try:
                yield LauncherRecord(**json.loads(path.read_text()))
            except (OSError, TypeError, ValueError) as exc:
                logger.warning("ignoring launcher record %s: %s", path, exc)

    def _path(self, job: str) -> Path:
        return self.directory / f"{job}.json"


def alive(rec: LauncherRecord) -> bool:
    """Whether the launcher still runs: its pid is the same process (the same start time), not a zombie."""
    try:
        started = running_since(rec.pid)
    except psutil.Error:
        return False
    return started is not None and abs(started - rec.started) <= 0.01

"""A job's history on the node's disk, for the post-mortem (`trainwarden report`, issue 27): every rank's step
times, the launcher's rounds and failures, and the goodput the launcher counted.

Written by `trainwarden run`'s supervisor (agent/launch/run.py), never by a worker: a step report costs the
telemetry reader one append to a list; a thread writes the list out every ``flush_every`` seconds. Kept in
``<job state dir>/history/`` and appended to by every run of the job, so a resumed job's report covers all of it:

- ``steps.csv``: ``rank,step,end_unix,duration_s``, one row per rank and step. Bounded for jobs of weeks: every
  step below ``FULL_STEPS``, then every 10th below ten times that, then every 100th (``kept_step``);
- ``events.jsonl``: one JSON object per line with ``t`` (unix seconds) and ``event``: ``launched`` (``node``,
  ``pid``), ``round_started`` (``round``, ``workers``), ``round_failed`` (``failures``: ``rank``, ``exitcode``,
  ``message``), ``restarting`` (``reason``), ``ended`` (``phase``, ``exit_code``);
- ``goodput.json``: the latest goodput snapshot (``wall_s``, ``productive_s``, ``badput_s`` by cause, ``ratio``).

The reader (``read_history``) skips what it cannot parse (a run killed mid-line) and says how many lines.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from trainwarden.agent.common.untrusted_fs import read_small_text
from trainwarden.agent.shared.atomic_file import atomic_write

logger = logging.getLogger(__name__)

__all__ = ["FULL_STEPS", "History", "JobHistory", "kept_step", "read_history"]

FULL_STEPS = 10_000
_HEADER = "rank,step,end_unix,duration_s\n"


def kept_step(step: int) -> bool:
    """Whether ``steps.csv`` keeps a row for ``step``: all below FULL_STEPS, then 1 in 10, then 1 in 100."""
    if step < FULL_STEPS:
        return True
    return step % (10 if step < 10 * FULL_STEPS else 100) == 0


class JobHistory:
    """The writer (module docstring). ``start()`` opens the files and the flushing thread; ``close()`` flushes."""

    def __init__(self, directory: str | Path, *, flush_every: float = 2.0,
                 goodput: Callable[[], dict | None] | None = None) -> None:
        self.directory = Path(directory)
        self._goodput = goodput
        self._flush_every = flush_every
        self._lock = threading.Lock()
        self._steps: list[str] = []
        self._events: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed = False

    def start(self) -> bool:
        """Open the files and start flushing; False (logged, and nothing kept from then on) when the directory
        cannot be written: the job runs without its history rather than not at all."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            steps = self.directory / "steps.csv"
            if not steps.exists() or steps.stat().st_size == 0:
                steps.write_text(_HEADER)
        except OSError as exc:
            logger.warning("cannot keep the job's history in %s (%s); `trainwarden report` will miss this run",
                           self.directory, exc)
            self._failed = True
            return False
        self._thread = threading.Thread(target=self._loop, name="trainwarden-history", daemon=True)
        self._thread.start()
        return True

    def step(self, rank: int, step: int, end: float, duration: float) -> None:
        """A rank's step (the telemetry reader's thread): one append, no I/O."""
        if kept_step(step) and not self._failed:
            row = f"{rank},{step},{end:.3f},{duration:.4f}\n"
            with self._lock:
                self._steps.append(row)

    def event(self, event: str, t: float | None = None, **fields: Any) -> None:
        if self._failed:
            return
        line = json.dumps({"t": round(time.time() if t is None else t, 3), "event": event, **fields},
                          default=str, sort_keys=True)
        with self._lock:
            self._events.append(line + "\n")

    def write_goodput(self) -> None:
        """The latest goodput from the ``goodput`` callable (one small file, replaced)."""
        snapshot = self._goodput() if self._goodput is not None else None
        if snapshot is None:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            atomic_write(self.directory / "goodput.json", json.dumps(snapshot, indent=1, sort_keys=True).encode())
        except OSError as exc:
            logger.warning("cannot write the job's goodput to %s: %s", self.directory, exc)

    def flush(self) -> None:
        with self._lock:
            steps, self._steps = self._steps, []
            events, self._events = self._events, []
        try:
            if steps:
                with open(self.directory / "steps.csv", "a", encoding="utf-8") as f:
                    f.writelines(steps)
            if events:
                with open(self.directory / "events.jsonl", "a", encoding="utf-8") as f:
                    f.writelines(events)
            if steps or events:
                self.write_goodput()
        except OSError as exc:  # a full disk loses history, never the job
            if not self._failed:
                logger.warning("cannot write the job's history to %s (%s); `trainwarden report` will miss it",
                               self.directory, exc)
            self._failed = True

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.flush()

    def _loop(self) -> None:
        while not self._stop.wait(self._flush_every):
            self.flush()


@dataclass
class History:
    """What ``read_history`` found: steps as parallel lists, events and the latest goodput."""

    rank: list[int] = field(default_factory=list)
    step: list[int] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    duration: list[float] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    goodput: dict | None = None
    skipped_lines: int = 0

    @property
    def empty(self) -> bool:
        return not self.step and not self.events


_STEPS_LIMIT = 512 << 20
_EVENTS_LIMIT = 64 << 20


def read_history(directory: str | Path) -> History:
    """Read ``<state dir>/history`` (module docstring); a missing directory is an empty history. The job's user
    writes it and root may read it (`trainwarden report`): no link is followed, no FIFO blocks, a file is read only up
    to a bound (agent/common/untrusted_fs.py)."""
    directory = Path(directory)
    h = History()
    try:
        text = read_small_text(directory / "steps.csv", _STEPS_LIMIT, under=directory.parent)
    except OSError:
        text = ""
    for row in csv.reader(io.StringIO(text)):
        if not row or row[0] == "rank":
            continue
        try:
            rank, step, end, duration = int(row[0]), int(row[1]), float(row[2]), float(row[3])
            if not (math.isfinite(end) and math.isfinite(duration)):
                raise ValueError
        except (ValueError, IndexError):
            h.skipped_lines += 1
            continue
        h.rank.append(rank)
        h.step.append(step)
        h.end.append(end)
        h.duration.append(duration)
    try:
        lines = read_small_text(directory / "events.jsonl", _EVENTS_LIMIT, under=directory.parent).splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            event = json.loads(line)
            if not isinstance(event, dict) or "event" not in event or "t" not in event:
                raise ValueError
            h.events.append(event)
        except ValueError:
            h.skipped_lines += 1
    try:
        h.goodput = json.loads(read_small_text(directory / "goodput.json", 1 << 20, under=directory.parent))
    except (OSError, ValueError):
        h.goodput = None
    return h

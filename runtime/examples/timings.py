"""Start-up phase timestamps of a worker, for the restart breakdown benchmark (tests/bench/bench_restart.py).

A restart costs what a fresh worker does before its first step: start an interpreter, import torch, join the
process groups, build the model, restore the checkpoint. The launcher's logs cannot see inside a worker, so
with ``TRAINWARDEN_TIMINGS`` naming a directory the worker marks each phase as it ends::

    timings = PhaseTimings.from_env(rank=rank)
    timings.mark("imported", IMPORTED_AT)   # a time taken earlier
    ...
    timings.mark("pg_up")                   # now

Each mark appends one JSON line ``{"phase", "t", "rank", "pid", "restart_count"}`` to
``<dir>/rank<R>-pid<P>.jsonl``; ``read_marks`` reads them all back. ``t`` is wall-clock time (``time.time()``)
because the benchmark sets it beside other processes' timestamps (the fault marker, the launcher's log lines);
``restart_count`` (torchrun's ``TORCHELASTIC_RESTART_COUNT``) tells the rounds apart.

Unset (the default), ``from_env`` returns a recorder whose ``mark`` returns at once: nothing is opened or
written, and the training loop pays one method call per mark, a handful per run.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Mapping

__all__ = ["TIMINGS_ENV", "PhaseTimings", "read_marks"]

logger = logging.getLogger(__name__)

TIMINGS_ENV = "TRAINWARDEN_TIMINGS"
"""A directory: workers write their phase marks there. Unset: no marks."""


class PhaseTimings:
    """One worker's phase marks (see the module docstring); a no-op without a directory."""

    def __init__(self, directory: str | os.PathLike | None, *, rank: int, restart_count: int = 0,
                 clock=time.time) -> None:
        self._path = Path(directory) / f"rank{rank}-pid{os.getpid()}.jsonl" if directory else None
        self._rank, self._restart_count, self._clock = rank, restart_count, clock

    @classmethod
    def from_env(cls, *, rank: int, env: Mapping[str, str] | None = None) -> "PhaseTimings":
        env = os.environ if env is None else env
        try:
            restart_count = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        except ValueError:
            restart_count = 0
        return cls(env.get(TIMINGS_ENV) or None, rank=rank, restart_count=restart_count)

    @property
    def enabled(self) -> bool:
        return self._path is not None

    def mark(self, phase: str, at: float | None = None) -> None:
        """Record that ``phase`` ended at ``at`` (default: now). Never raises: a mark is evidence, not work."""
        if self._path is None:
            return
        line = json.dumps({"phase": phase, "t": self._clock() if at is None else at, "rank": self._rank,
                           "pid": os.getpid(), "restart_count": self._restart_count})
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            with open(self._path, "a") as f:
                f.write(line + "\n")
        except OSError as exc:
            logger.warning("cannot write the phase mark %s to %s: %s", phase, self._path, exc)
            self._path = None  # said once; the run goes on without marks


def read_marks(directory: str | os.PathLike) -> list[dict]:
    """Every mark written under ``directory``, in no particular order; a torn last line is skipped."""
    marks = []
    for path in sorted(Path(directory).glob("rank*-pid*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                marks.append(json.loads(line))
            except ValueError:
                continue
    return marks

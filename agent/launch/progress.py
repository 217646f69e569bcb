"""A job's progress as the supervisor of `trainwarden run` sees it: steps, worker rounds, failures and the
time each failure cost.

Structured sources, in this order of trust:

- the launcher's events (agent/launch/elastic.py): a worker round started, the round failed (which workers,
  exit codes, error files), the agent restarts the group;
- the workers' telemetry (every ``rt.step`` of every rank, through the in-process agent): step indices and
  their wall-clock end times.

Log lines are a fallback for scripts that send no telemetry (run with ``--no-agent``, or scripts that never
call ``rt.step``): ``feed_line`` reads the reference job's ``step N loss X time Ys`` lines, and is ignored
once telemetry has reported a step. torchrun's wording is never read.

Time lost to a failure = from the end of the last step completed before it to the end of the first step
that passes it again (the restart, the rendezvous, the restore and the recomputed steps), in the workers'
wall-clock time (the steps' own timestamps; one host's clock). A failure that comes before the one before it
recovered takes over from it: the earlier one is charged up to it, so each second is charged once.
"""

from __future__ import annotations

import re
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

__all__ = ["Failure", "JobProgress", "STEP_LINE"]

STEP_LINE = re.compile(r"\bstep (\d+) loss (\S+) time ([0-9.]+)s")
"""The reference job's step line; read only for scripts that send no telemetry."""


_WORKERS_KEPT = 4096
"""Workers whose highest counted step is kept (``step``). Kept as a set of every (worker, step), it grew by one
entry per step and local rank: 2,400 steps of four ranks are 9,600 entries, 1.3 MB (tracemalloc): a fifth of the 6.4 MB
the launcher grew by in issue 45's hour-long soak."""


@dataclass
class Failure:
    """One failed worker round and what it cost."""

    at: float
    """Wall time the launcher reported the failure."""
    last_step: int | None
    """Highest step completed before it."""
    last_step_at: float | None
    """Wall time that step ended."""
    recovered_at: float | None = None
    """Wall time the job passed ``last_step`` again."""
    resumed_from: int | None = None
    """First step completed in the next round (the checkpoint's step + 1)."""
    next_round_at: float | None = None
    """Wall time the next worker round started."""
    charged_from: float | None = None
    """Set when the failure before had not recovered yet: that one is charged up to this failure, this one from
    here (failures in a row are not each charged from the first one's last good step)."""
    superseded_at: float | None = None
    """Wall time the next failure came before this one recovered: this one is charged up to it."""

    @property
    def lost_seconds(self) -> float | None:
        start = self.last_step_at if self.last_step_at is not None else self.at
        if self.charged_from is not None:
            start = max(start, self.charged_from)
        if self.superseded_at is not None:
            end = self.superseded_at if self.recovered_at is None else min(self.recovered_at, self.superseded_at)
        elif self.recovered_at is None:
            return None
        else:
            end = self.recovered_at
        return max(0.0, end - start)


class JobProgress:
    """Feed it launcher events, telemetry steps and (as a fallback) output lines; read the job's progress.

    Thread-safe: the telemetry reader, the event reader and the output pump feed it concurrently.
    """

    def __init__(self, *, wall: Callable[[], float] = time.time) -> None:
        self._wall = wall
        self._lock = threading.Lock()
        self.max_step: int | None = None
        self.last_loss: str | None = None
        self.source: str | None = None
        """"telemetry" or "log": where the steps came from."""
        self.failures: list[Failure] = []
        self.restarts = 0
        """Worker-group restarts after a failure (membership changes are not counted)."""
        self.rounds = 0
        self._round_started_at: float | None = None
        self._round_has_step = False
        self._max_step_at: float | None = None
        self._durations: deque[float] = deque(maxlen=4096)
        self._counted: dict[int, int] = {}  # worker (pid) -> the highest step index counted of it: once each

    # ---- feeds ---------------------------------------------------------------------------------------

    def round_started(self, at: float | None = None) -> None:
        """The launcher started a worker round."""
        with self._lock:
            self.rounds += 1
            self._round_started_at = self._wall() if at is None else at
            self._round_has_step = False
            for failure in self.failures:
                if failure.next_round_at is None:
                    failure.next_round_at = self._round_started_at

    def round_failed(self, at: float | None = None) -> Failure:
        """The launcher reported the round failed."""
        with self._lock:
            failure = Failure(at=self._wall() if at is None else at, last_step=self.max_step,
                              last_step_at=self._max_step_at)
            before = self.failures[-1] if self.failures else None
            if before is not None and before.recovered_at is None and before.superseded_at is None:
                before.superseded_at = failure.charged_from = failure.at  # one failure's time is charged once
            self.failures.append(failure)
            return failure

    def restarting(self, after_failure: bool) -> None:
        with self._lock:
            if after_failure:
                self.restarts += 1

    def step(self, index: int, end_wall: float, duration_s: float, *, source: str = "telemetry",
             worker: int = 0) -> bool:
        """A completed step (any rank; each (worker, index) counts once). True when it is the first step of
        the current worker round."""
        with self._lock:
            if source == "log" and self.source == "telemetry":
                return False
            if source == "telemetry" and self.source == "log":  # telemetry arrived after all: trust it
                self._reset_steps()
            self.source = source
            if index <= self._counted.get(worker, -1):  # a worker's steps come in order; again after a rollback
                return False
            if len(self._counted) >= _WORKERS_KEPT and worker not in self._counted:
                self._counted.clear()  # workers of long-gone rounds (a few per round): bounded, not a set of every step
            self._counted[worker] = index
            self._durations.append(duration_s)
            first_in_round = not self._round_has_step and (
                self._round_started_at is None or end_wall >= self._round_started_at)
            if first_in_round:
                self._round_has_step = True
            for failure in self.failures:
                if failure.next_round_at is None or end_wall < failure.next_round_at:
                    # a step of the failed round, reported late (a rank's last batch reaches the agent after
                    # the launcher's report): it was completed before the failure, so it counts there
                    if end_wall <= failure.at and (failure.last_step is None or index > failure.last_step):
                        failure.last_step, failure.last_step_at = index, end_wall
                    continue
                if failure.resumed_from is None:
                    failure.resumed_from = index
                if failure.recovered_at is None and (failure.last_step is None or index > failure.last_step):
                    failure.recovered_at = end_wall
            if self.max_step is None or index > self.max_step:
                self.max_step, self._max_step_at = index, end_wall
            return first_in_round

    def feed_line(self, line: str) -> tuple[int, bool] | None:
        """Fallback for scripts without telemetry: a ``step N loss X time Ys`` line. (step, first in round)
        when the line is one; the loss shown in the summary comes only from here."""
        match = STEP_LINE.search(line)
        if not match:
            return None
        index = int(match.group(1))
        self.last_loss = match.group(2)
        return index, self.step(index, self._wall(), float(match.group(3)), source="log", worker=self.rounds)

    def _reset_steps(self) -> None:
        self.max_step = self._max_step_at = None
        self._durations.clear()
        self._counted.clear()

    # ---- readers -------------------------------------------------------------------------------------

    @property
    def in_round(self) -> bool:
        """A step completed in the current worker round."""
        return self._round_has_step

    @property
    def lost_seconds(self) -> float:
        return sum(f.lost_seconds or 0.0 for f in self.failures)

    def median_step_seconds(self, last: int | None = None) -> float | None:
        """The median step duration of the run (every rank's), or of the ``last`` ones reported."""
        with self._lock:
            durations = list(self._durations)[-last:] if last else self._durations
            return statistics.median(durations) if durations else None

"""Job progress as seen from the launcher's side of the process boundary.

``ProgressTracker`` reads the lines a job prints (the reference job's ``step N loss X time Ys`` and
torchrun's "will restart worker group") and keeps what a person wants at the end of a run: steps
done, restarts, and the wall time each failure cost. It works with any script that prints step
lines in that shape and needs no agent, which is what makes the `trainwarden run` summary
trustworthy even when telemetry is off.

Time lost to a failure = from the last step completed before it to the moment the job passes that
step again (the restart, the rendezvous, the restore and the recomputed steps), measured with the
monotonic clock.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

__all__ = ["Failure", "ProgressTracker", "RESTART_LINE", "STEP_LINE"]

STEP_LINE = re.compile(r"\bstep (\d+) loss (\S+) time ([0-9.]+)s")
RESTART_LINE = re.compile(r"will restart worker group")


@dataclass
class Failure:
    """One worker-group failure and what it cost."""

    at: float
    """Monotonic time the restart was announced."""
    last_step: int | None
    """Highest step completed before it."""
    last_step_at: float | None
    """Monotonic time of that step."""
    recovered_at: float | None = None
    """When the job passed ``last_step`` again."""
    resumed_from: int | None = None
    """First step printed after the restart (checkpoint step + 1)."""

    @property
    def lost_seconds(self) -> float | None:
        if self.recovered_at is None:
            return None
        return self.recovered_at - (self.last_step_at if self.last_step_at is not None else self.at)


@dataclass
class ProgressTracker:
    """Feed it every output line; read steps, losses, restarts and failures from it."""

    clock: callable = time.monotonic
    started_at: float = field(default=None)
    max_step: int | None = None
    last_loss: str | None = None
    steps_seen: int = 0
    step_seconds: list[float] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    _last_step_at: float | None = None

    def __post_init__(self) -> None:
        if self.started_at is None:
            self.started_at = self.clock()

    @property
    def restarts(self) -> int:
        return len(self.failures)

    @property
    def lost_seconds(self) -> float:
        return sum(f.lost_seconds or 0.0 for f in self.failures)

    def feed(self, line: str) -> None:
        now = self.clock()
        match = STEP_LINE.search(line)
        if match:
            step = int(match.group(1))
            self.steps_seen += 1
            self.last_loss = match.group(2)
            self.step_seconds.append(float(match.group(3)))
            for failure in self.failures:
                if failure.resumed_from is None:
                    failure.resumed_from = step
                if failure.recovered_at is None and (failure.last_step is None or step > failure.last_step):
                    failure.recovered_at = now
            if self.max_step is None or step > self.max_step:
                self.max_step = step
                self._last_step_at = now
            return
        if RESTART_LINE.search(line):
            self.failures.append(Failure(at=now, last_step=self.max_step, last_step_at=self._last_step_at))

    def median_step_seconds(self) -> float | None:
        if not self.step_seconds:
            return None
        ordered = sorted(self.step_seconds)
        return ordered[len(ordered) // 2]

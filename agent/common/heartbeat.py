"""A background loop's proof of life: when it last finished an iteration, and whether that was too long ago.

``Thread.is_alive`` cannot tell a loop that works from one that is stuck (a deadlock, a call that never
returns): both are alive. So each periodic loop the daemon depends on calls ``beat()`` after every iteration,
one that failed included (a loop that keeps failing is not wedged: it logs and counts its failures, and a
restart would not cure them), and ``problem()`` says, in one line for the log and systemd's status, whether the
thread has ended or has not finished an iteration for longer than ``stall_s``. The daemon sends systemd its
keep-alives only while every part answers None (agent/node/liveness.py).

``stall_s`` is the longest an iteration may legitimately take plus a margin: a loop that waits on etcd, on a
worker's diagnostics or on a slow filesystem needs minutes, not its interval. The clock is injected, so a
stalled loop is testable without waiting for it.
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["Heartbeat"]


class Heartbeat:
    """When the loop ``name`` last finished an iteration (monotonic time); see the module docstring."""

    def __init__(self, name: str, *, stall_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not stall_s > 0:
            raise ValueError(f"heartbeat {name!r}: stall_s must be positive, got {stall_s!r}")
        self.name, self.stall_s, self._clock = name, stall_s, clock
        self._last = clock()  # from its creation: a loop that never finishes its first iteration stalls too

    def beat(self) -> None:
        """One iteration finished (a float store: safe from any thread without a lock)."""
        self._last = self._clock()

    def age_s(self) -> float:
        """Seconds since the latest beat (or since the heartbeat was made)."""
        return max(0.0, self._clock() - self._last)

    def problem(self, *, running: bool) -> str | None:
        """None while the loop is alive and beating; else why not. ``running``: whether its thread is alive."""
        if not running:
            return f"{self.name}: its thread has ended"
        age = self.age_s()
        if age > self.stall_s:
            return f"{self.name}: no iteration finished for {age:.0f} s (limit {self.stall_s:.0f} s)"
        return None

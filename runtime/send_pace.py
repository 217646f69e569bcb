"""When the telemetry sender may hold the steps it queued, and what it then promises the agent.

Every send costs the worker Python time with the GIL held, plus gRPC's own threads: about 0.3-1 ms a message on
the 2-core machine, so two sends a second were half of what watching a 50 ms step cost (BENCHMARKS.md, issue 48
item 6). While no detector of the job is near a decision, the agent asks for fewer (``ReadPace.step_send_seconds``).
The sender still wakes every flush interval and looks at its queue, which costs no message:

- steps keep ending (the newest one ended less than ``max(STALL_AFTER_S, 1.5 step intervals)`` ago) and a batch
  sent less than ``asked_s`` ago said more would follow: hold them;
- otherwise send what is queued. A batch sent while steps keep ending promises the next within ``asked_s``
  (``Steps.next_within_seconds``); one sent when they stopped promises nothing, and is sent even empty when the
  last batch had promised. The agent hears of a stall within that time and a look, before its hang deadline (at
  least 1.5 s, and 5 step times), so a hang is detected when it was.

The first batch after a stop, after a new stream or after the agent asked again is sent at once, so the agent
never waits on a promise it was not given. Only the sender thread calls this (the training thread only appends).
"""

from __future__ import annotations

from typing import Callable

from trainwarden.agent.shared.contract import MAX_STEP_SEND_S, STEPS_STOPPED_AFTER_S

__all__ = ["STALL_AFTER_S", "SendPace"]

STALL_AFTER_S = STEPS_STOPPED_AFTER_S
"""Steps have stopped once none ended for this long, or 1.5 of their recent intervals if longer: with a look every
0.5 s the agent hears of it within 1.25 s of the last step at the floor (its hang deadline is 1.5 s at least)."""
_HOLD_AT_MOST = 256
"""Records queued beyond which a look sends whatever the pace (one message's worth of steps)."""


class SendPace:
    """One stream's step-send pace (module docstring)."""

    def __init__(self, flush_s: float, step_end: Callable[[tuple], float | None]) -> None:
        """`step_end(record)`: the wall time a queued step record ended, None for another kind of record."""
        self._flush_s, self._step_end = flush_s, step_end
        self.asked_s = 0.0
        """The hold the agent asked for on this stream; 0: send at every look that finds something."""
        self._tail: tuple | None = None  # the newest record at the last look (kept: its identity is the mark)
        self._seen = 0  # records queued at the last look, since the last send
        self._newest_end = 0.0  # wall time the newest step seen ended (0: none yet)
        self._interval = 0.0  # recent time between step ends (a moving average)
        self._flowing = False  # at the last look, steps kept ending
        self._promised = False  # the last batch sent promised the next
        self._last_send = 0.0  # monotonic
        self.held = 0
        """Looks that held the queue (``rt.stats``)."""

    def new_stream(self) -> None:
        """A new stream starts at the worker's own pace, with nothing promised."""
        self.asked_s, self._promised = 0.0, False

    def ask(self, seconds: float) -> None:
        """The agent's ``step_send_seconds``: no longer than `MAX_STEP_SEND_S`; one flush or less is none."""
        seconds = min(MAX_STEP_SEND_S, seconds) if seconds == seconds else 0.0
        self.asked_s = seconds if seconds > self._flush_s else 0.0

    def look(self, queue, wall: float) -> None:
        """At each wake-up: the steps queued since the last look (the newest record's identity says), and whether
        steps keep ending as of wall time `wall`."""
        tail = queue[-1] if queue else None
        queued = len(queue)
        if tail is not None and tail is not self._tail:
            end = self._step_end(tail)
            new = queued - self._seen
            if end is not None and new > 0 and end > self._newest_end:
                if self._newest_end:
                    gap = (end - self._newest_end) / new
                    self._interval = gap if not self._interval else 0.8 * self._interval + 0.2 * gap
                self._newest_end = end
        self._tail, self._seen = tail, queued
        stall_after = max(STALL_AFTER_S, 1.5 * self._interval)
        self._flowing = self._newest_end > 0 and wall - self._newest_end < stall_after

    def may_hold(self, now: float, queued: int) -> bool:
        """After a timed look with nothing due at once: True to send nothing this time. `now`: monotonic."""
        if (self._flowing and self._promised and self.asked_s > 0 and now - self._last_send < self.asked_s
                and queued < _HOLD_AT_MOST):
            self.held += 1
            return True
        return False

    def sending(self, now: float, *, final: bool = False) -> tuple[float, bool]:
        """A batch goes now (the queue is drained): (what it promises, in seconds, 0 for nothing; whether it must go
        even with no step in it: it withdraws the last batch's promise). The last batch of a stream promises
        nothing."""
        within = self.asked_s if self._flowing and self.asked_s > 0 and not final else 0.0
        withdraw = self._promised and within == 0
        self._promised, self._last_send, self._seen = within > 0, now, 0
        return within, withdraw

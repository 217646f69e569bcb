"""When the telemetry sender may hold the steps it queued, and what it then promises the agent.

Every send costs the worker Python time with the GIL held, plus gRPC's own threads: about 0.3-1 ms a message on
the 2-core machine, so two sends a second were half of what watching a 50 ms step cost (BENCHMARKS.md, issue 48
item 6). While no detector of the job is near a decision, the agent asks for fewer (``ReadPace.step_send_seconds``).
The sender still wakes every flush interval and looks at its queue, which costs no message:

- steps keep ending (a step was queued since the last look) and a batch sent less than ``asked_s`` ago said more
  would follow: hold them;
- otherwise send what is queued. A batch sent while steps keep ending promises the next within ``asked_s``
  (``Steps.next_within_seconds``); one sent when they stopped promises nothing, and is sent even empty when the
  last batch had promised: the agent then hears of a stall within a flush interval, as before, and a hang is
  detected as soon as it was.

The first batch after a stop, after a new stream or after the agent asked again is sent at once, so the agent
never waits on a promise it was not given. Only the sender thread calls this (the training thread only appends).
"""

from __future__ import annotations

from trainwarden.agent.shared.contract import MAX_STEP_SEND_S

__all__ = ["SendPace"]
_HOLD_AT_MOST = 256
"""Records queued beyond which a look sends whatever the pace (one message's worth of steps)."""


class SendPace:
    """One stream's step-send pace (module docstring)."""

    def __init__(self, flush_s: float, step_tag: str) -> None:
        self._flush_s, self._step_tag = flush_s, step_tag
        self.asked_s = 0.0
        """The hold the agent asked for on this stream; 0: send at every look that finds something."""
        self._tail: tuple | None = None  # the newest record at the last look (kept: its identity is the mark)
        self._flowing = False  # the last look found a step queued since the one before
        self._promised = False  # the last batch sent promised the next
        self._last_send = 0.0
        self.held = 0
        """Looks that held the queue (``rt.stats``)."""

    def new_stream(self) -> None:
        """A new stream starts at the worker's own pace, with nothing promised."""
        self.asked_s, self._promised = 0.0, False

    def ask(self, seconds: float) -> None:
        """The agent's ``step_send_seconds``: no longer than `MAX_STEP_SEND_S`; one flush or less is none."""
        seconds = min(MAX_STEP_SEND_S, seconds) if seconds == seconds else 0.0
        self.asked_s = seconds if seconds > self._flush_s else 0.0

    def look(self, queue) -> None:
        """At each wake-up: was a step queued since the last look? (The newest record's identity says.)"""
        tail = queue[-1] if queue else None
        self._flowing = tail is not None and tail is not self._tail and tail[0] == self._step_tag
        self._tail = tail

    def may_hold(self, now: float, queued: int) -> bool:
        """After a timed look with nothing sent at once: True to send nothing this time. `now`: monotonic."""
        if (self._flowing and self._promised and self.asked_s > 0 and now - self._last_send < self.asked_s
                and queued < _HOLD_AT_MOST):
            self.held += 1
            return True
        return False

    def sending(self, now: float, *, final: bool = False) -> tuple[float, bool]:
        """A batch goes now: (what it promises, in seconds, 0 for nothing; whether it must go even with no step in
        it: it withdraws the last batch's promise). The last batch of a stream promises nothing."""
        within = self.asked_s if self._flowing and self.asked_s > 0 and not final else 0.0
        withdraw = self._promised and within == 0
        self._promised, self._last_send = within > 0, now
        return within, withdraw

"""The daemon's word to systemd: ready once it serves, alive while it works, stopping when it stops.

Under ``Type=notify`` systemd counts the unit as started only when the daemon says ``READY=1``, so
``systemctl start`` and the units ordered after it see an agent that answers, not one still binding its socket.
``KeepAlive.tick()``, called from the daemon's main loop, sends it the first time ``check()`` (the agent's and the
job runner's ``liveness()``: agent/node/agent.py) finds every part working, with a ``STATUS=`` line that says
where the agent serves.

With ``WatchdogSec=`` it then sends ``WATCHDOG=1`` every half interval, each after a fresh ``check()`` and only
when that passes. A wedged part (a loop that finishes no iteration, a gRPC server that does not answer its own
health check, a thread that ended) stops the keep-alives: the problem is logged once and shown in ``STATUS=``,
and systemd kills the daemon after ``WatchdogSec`` (SIGABRT: faulthandler writes every thread's stack to the
journal first) and, under ``Restart=always``, starts a new one. With ``KillMode=process`` the jobs keep running
and the new daemon adopts them (agent/node/job_runner.py). The main thread is covered too: a daemon whose main
loop is stuck sends nothing either. One failed check costs nothing by itself: systemd acts only when a whole
interval passes without a keep-alive, about two failed checks in a row.

Without ``NOTIFY_SOCKET`` (not under systemd) nothing is checked or sent. The clock is injected for tests.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from trainwarden.agent.common.sdnotify import SdNotifier

logger = logging.getLogger(__name__)

__all__ = ["KeepAlive"]

_READY_RETRY_S = 0.5


class KeepAlive:
    """Readiness and keep-alives for systemd, from ``check()``; see the module docstring."""

    def __init__(self, notifier: SdNotifier, check: Callable[[], str | None], *, status: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``check()``: None while the daemon works, else what does not, in one line. ``status``: the
        ``STATUS=`` line while it works."""
        self._notifier, self._check, self._status, self._clock = notifier, check, status, clock
        self.period_s = notifier.watchdog_s / 2 if notifier.watchdog_s else None
        """Seconds between keep-alives: half systemd's interval, as sd_watchdog_enabled(3) advises."""
        self.ready = False
        self._due = clock()
        self._problem: str | None = None  # what stopped the keep-alives, while they are stopped

    def _idle(self) -> bool:
        return not self._notifier.enabled or (self.ready and self.period_s is None)

    def wait_s(self, longest: float) -> float:
        """How long the main loop may wait before the next ``tick()`` is due (at most ``longest``)."""
        if self._idle():
            return longest
        return min(longest, max(0.0, self._due - self._clock()))

    def tick(self) -> None:
        """Send whatever is due: ``READY=1`` until it is sent, then a keep-alive each period while healthy."""
        if self._idle():
            return
        now = self._clock()
        if now < self._due:
            return
        problem = self._run_check()
        if not self.ready:
            self._become_ready(problem, now)
            return
        self._due = now + self.period_s  # from the check's start: a slow check does not stretch the period
        if problem is None:
            self._notifier.watchdog()
            if self._problem is not None:
                logger.warning("the agent works again; keep-alives to systemd resumed")
                self._notifier.status(self._status)
                self._problem = None
            return
        if self._problem is None:  # once per episode, though the text (a stall's age) changes every check
            logger.error("not sending systemd its keep-alive: %s. systemd restarts the agent once %g s pass without "
                         "one; the jobs on this node keep running and the new agent adopts them", problem,
                         self._notifier.watchdog_s)
        self._problem = problem
        self._notifier.status(f"wedged, keep-alives stopped: {problem}")

    def stopping(self, why: str) -> None:
        """``STOPPING=1``: the daemon is shutting down on purpose (no keep-alives are expected any more)."""
        self._notifier.stopping(f"stopping: {why}")

    def _become_ready(self, problem: str | None, now: float) -> None:
        if problem is not None:
            if self._problem is None:
                logger.info("not telling systemd the agent is ready yet: %s", problem)
            self._problem = problem
            self._due = now + _READY_RETRY_S
            return
        self._notifier.ready(self._status)
        self.ready, self._problem = True, None
        if self.period_s is not None:
            self._due = now + self.period_s
        logger.info("told systemd the agent is ready%s", f"; a keep-alive every {self.period_s:g} s while it works"
                    if self.period_s is not None else "")

    def _run_check(self) -> str | None:
        try:
            return self._check()
        except Exception as exc:  # a broken check must not take the daemon down; it is a problem like any other
            logger.debug("liveness check raised", exc_info=True)
            return f"the liveness check failed: {exc!r}"

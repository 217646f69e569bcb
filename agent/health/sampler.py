"""The background loop shared by the health samplers: sample at an interval, survive bad samples.

A health sampler reads slow or flaky sources (NVML, ``/proc``) that must never run on a Prometheus
scrape's request thread: a scrape that blocks on a wedged GPU driver would time out and lose every
other metric with it. So each sampler owns one daemon thread that calls its ``sample`` function every
``interval_s`` seconds and keeps the latest result; the collector reads that result at scrape time.

The loop follows the house rule for background loops: one bad iteration is logged and counted, the loop
carries on; ``stop()`` sets an event and joins with a timeout; the thread never takes the process down.
Durations use the injected monotonic clock, so the age of the latest sample is testable without sleeping.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)

__all__ = ["PeriodicSampler"]


class PeriodicSampler:
    """Calls ``sample_fn`` now and then every ``interval_s`` seconds on a daemon thread.

    ``sample_once()`` runs one iteration on the caller's thread (tests use it to stay deterministic).
    ``errors`` counts iterations that raised; ``last_success`` is the monotonic time of the latest
    iteration that did not.
    """

    def __init__(
        self,
        name: str,
        interval_s: float,
        sample_fn: Callable[[], None],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"sampler {name!r}: interval_s must be > 0, got {interval_s!r}")
        self._name = name
        self._interval_s = interval_s
        self._sample_fn = sample_fn
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._errors = 0
        self._last_success: float | None = None

    @property
    def errors(self) -> int:
        """Number of iterations that raised since construction."""
        with self._lock:
            return self._errors

    @property
    def last_success(self) -> float | None:
        """Monotonic time of the latest successful iteration, or None before the first one."""
        with self._lock:
            return self._last_success

    def age_s(self) -> float | None:
        """Seconds since the latest successful iteration, or None before the first one."""
        last = self.last_success
        return None if last is None else max(0.0, self._clock() - last)

    def sample_once(self) -> bool:
        """Run one iteration; log and count an exception instead of raising it. True on success."""
        try:
            self._sample_fn()
        except Exception:  # one bad sample must not end the loop
            with self._lock:
                self._errors += 1
            logger.exception("health sampler %s: sample failed; keeping the previous sample", self._name)
            return False
        with self._lock:
            self._last_success = self._clock()
        return True

    def start(self) -> None:
        """Start the thread; the first sample is taken immediately. Starting twice is an error."""
        if self._thread is not None:
            raise RuntimeError(f"health sampler {self._name!r} already started; create a new one to restart")
        self._thread = threading.Thread(target=self._run, name=f"trainwarden-{self._name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Ask the thread to stop and join it. Returns False if it is still running after ``timeout_s``."""
        self._stop.set()
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout_s)
        if thread.is_alive():
            logger.warning("health sampler %s did not stop within %.1fs", self._name, timeout_s)
            return False
        return True

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            if self._stop.wait(self._interval_s):
                break

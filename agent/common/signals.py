"""SIGINT and SIGTERM as an event that a main loop waits on.

``StopOnSignals`` installs handlers for the life of a ``with`` block and puts the previous ones back on exit;
the first signal is kept in ``received`` (the command's exit code says which it was), a second one only sets
the event again, so cleanup already under way is never interrupted. ``ExternalStop`` stands in for it when
the caller owns stopping (a test, or an embedding that runs the loop off the main thread).
"""

from __future__ import annotations

import signal
import threading
from typing import Callable

__all__ = ["ExternalStop", "StopOnSignals"]


class StopOnSignals:
    """SIGINT/SIGTERM set ``event``; ``on_first(signum)`` runs once, for the first signal."""

    def __init__(self, on_first: Callable[[int], None] | None = None) -> None:
        self.event = threading.Event()
        self.received: int | None = None
        self._on_first = on_first
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopOnSignals":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            if self._on_first is not None:
                self._on_first(signum)
        self.event.set()

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class ExternalStop:
    """The ``StopOnSignals`` interface over an event the caller sets; no signal handler is touched."""

    def __init__(self, event: threading.Event) -> None:
        self.event, self.received = event, None

    def __enter__(self) -> "ExternalStop":
        return self

    def __exit__(self, *exc) -> None:
        pass

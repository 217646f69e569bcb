"""Reading the launcher's structured events (agent/launch/elastic.py) on the supervisor's side.

``LaunchEventReader`` reads JSON lines from the pipe the launcher writes to and hands each event, a dict
with at least ``event`` and ``t``, to a callback on its own thread. A line that is not JSON is logged and
skipped; the thread ends when the launcher closes the pipe (it exited).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Callable

logger = logging.getLogger(__name__)

__all__ = ["LaunchEventReader"]


class LaunchEventReader(threading.Thread):
    def __init__(self, fd: int, on_event: Callable[[dict], None]) -> None:
        super().__init__(name="trainwarden-launch-events", daemon=True)
        self._fd, self._on_event = fd, on_event

    def run(self) -> None:
        with os.fdopen(self._fd, "r", encoding="utf-8", errors="replace") as pipe:
            for line in pipe:
                try:
                    event = json.loads(line)
                    if not isinstance(event, dict) or "event" not in event:
                        raise ValueError("not an event object")
                except ValueError as exc:
                    logger.warning("ignoring a malformed launch event (%s): %r", exc, line[:200])
                    continue
                try:
                    self._on_event(event)
                except Exception:  # one bad event must not end the reader
                    logger.exception("handling launch event %s failed", event.get("event"))

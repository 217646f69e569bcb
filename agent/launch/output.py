"""The job's output: torchrun's stdout and stderr (and so every worker's), copied to the terminal and the
job's ``run.log``, each line handed to the progress tracker and to the supervisor's line handler.

torchrun's own INFO lines (glog style) go to the log file only, except the restart announcement; while the
job is being stopped (``quiet``), nothing goes to the terminal, so torchrun's shutdown tracebacks stay in the
log.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Callable, TextIO

from trainwarden.agent.launch.progress import RESTART_LINE, ProgressTracker

logger = logging.getLogger(__name__)

__all__ = ["OutputPump"]

# torchrun's own INFO lines (glog style, "I1122 14:37:14.328000 ...") go to the log file only
_TORCHRUN_INFO = re.compile(r"^\[?I\d{4} \d\d:\d\d:\d\d")


class OutputPump(threading.Thread):
    """Copies torchrun's output to our stdout and the run log, feeding the progress tracker."""

    def __init__(self, source, sink: TextIO, log: TextIO, tracker: ProgressTracker,
                 on_line: Callable[[str], None]) -> None:
        super().__init__(name="trainwarden-output", daemon=True)
        self._source, self._sink, self._log = source, sink, log
        self._tracker, self._on_line = tracker, on_line
        self.quiet = False
        """Set while stopping: torchrun's shutdown tracebacks go to the log, not the terminal."""

    def run(self) -> None:
        for raw in iter(self._source.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            try:
                self._log.write(line)
                if not self.quiet and (not _TORCHRUN_INFO.match(line) or RESTART_LINE.search(line)):
                    self._sink.write(line)
                    self._sink.flush()
                self._tracker.feed(line)
                self._on_line(line)
            except Exception:  # a broken terminal must not stop the job's log or the tracker
                logger.exception("error while handling job output")

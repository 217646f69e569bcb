"""The job's output: torchrun's stdout and stderr (and so every worker's), copied to the terminal and the
job's ``run.log``, each line handed to the progress tracker and to the supervisor's line handler.

torchrun's own INFO lines (glog style) go to the log file only (the supervisor announces restarts itself, from
the launcher's events); while the job is being stopped (``quiet``), nothing goes to the terminal, so
torchrun's shutdown tracebacks stay in the log. A log file that cannot be written (a full disk) is said once
on the terminal and skipped; the terminal, the progress fallback and the line handler go on.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Callable, TextIO


logger = logging.getLogger(__name__)

__all__ = ["OutputPump"]

# torchrun's own INFO lines (glog style, "I1122 14:37:14.328000 ...") go to the log file only
_TORCHRUN_INFO = re.compile(r"^\[?I\d{4} \d\d:\d\d:\d\d")


class OutputPump(threading.Thread):
    """Copies torchrun's output to our stdout and the run log, feeding the progress tracker."""

    def __init__(self, source, sink: TextIO, log: TextIO, on_line: Callable[[str], None]) -> None:
        super().__init__(name="trainwarden-output", daemon=True)
        self._source, self._sink, self._log = source, sink, log
        self._on_line = on_line
        self.quiet = False
        """Set while stopping: torchrun's shutdown tracebacks go to the log, not the terminal."""
        self.log_error: OSError | None = None
        """Why the log file is not being written, once a write failed."""

    def run(self) -> None:
        for raw in iter(self._source.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            self._write_log(line)
            try:
                if not self.quiet and not _TORCHRUN_INFO.match(line):
                    self._sink.write(line)
                    self._sink.flush()
            except Exception:  # a broken terminal must not stop the job's log or the progress
                logger.exception("error while writing job output to the terminal")
            try:
                self._on_line(line)
            except Exception:
                logger.exception("error while handling job output")

    def _write_log(self, line: str) -> None:
        if self.log_error is not None:
            return
        try:
            self._log.write(line)
        except OSError as exc:  # disk full, I/O error: say it once, keep everything else going
            self.log_error = exc
            message = (f"trainwarden: cannot write the job's log {getattr(self._log, 'name', '')}: "
                       f"{exc.strerror or exc}; the job goes on and its output still shows here\n")
            logger.error("%s", message.strip())
            try:
                if not self.quiet:
                    self._sink.write(message)
                    self._sink.flush()
            except Exception:
                pass

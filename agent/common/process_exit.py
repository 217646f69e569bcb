"""Leaving a finished command's process without the interpreter's finalization.

A process that has loaded torch or gRPC spends 1 to 2 s in finalization after its work is done (measured with
py-spy on this machine: no Python frame left, only teardown): the launcher after torchrun ends, and ``trainwarden
run`` after its own cleanup. Every launch's end paid it twice. ``exit_now`` is for process entry points only (never
for ``main`` called in-process, as the tests do): it waits a bounded time for threads that were not made daemons, as
the interpreter would, flushes the logs and the standard streams, then ``os._exit``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import NoReturn

__all__ = ["exit_now"]


def exit_now(code: int | None, *, join_s: float = 5.0) -> NoReturn:
    """Exit with ``code`` (None: 0) once non-daemon threads end (at most ``join_s`` in all) and output is flushed."""
    deadline = time.monotonic() + join_s
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code or 0)

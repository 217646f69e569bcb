"""The agent's abort, carried out in the worker: log why, flush, abort NCCL's communicators (bounded), and exit the
whole process at once with ``EXIT_ABORTED`` (session.py calls it on the agent's Abort command, from any thread).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Callable

from trainwarden.agent.shared.contract import EXIT_ABORTED

__all__ = ["EXIT_ABORTED", "abort_collectives", "abort_process"]

log = logging.getLogger(__name__)


def abort_process(reason: str, flush: Callable[[], None], *, collectives_timeout_s: float = 1.0) -> None:
    """Log `reason`, flush, abort NCCL communicators, and exit the whole process now with EXIT_ABORTED
    (from any thread). The abort gets `collectives_timeout_s`: within the agent's grace (ABORT_GRACE_S,
    1.5 s) before it SIGKILLs what has not exited."""
    log.error("aborted by the trainwarden agent: %s", reason)
    try:
        flush()
        abort_collectives(collectives_timeout_s)
        for handler in logging.getLogger().handlers:
            handler.flush()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(EXIT_ABORTED)


def abort_collectives(timeout_s: float, *, dist=None) -> str:
    """On NCCL, abort every process group before the process exits: a kernel wedged in a collective
    otherwise keeps the GPU (and its peers' communicators) busy into the restart. Gloo needs nothing: its
    collectives end with the process. Bounded by `timeout_s` (an abort can itself block on a wedged
    driver); returns what was done, for the log and the tests."""
    if dist is None:
        dist = sys.modules.get("torch.distributed")  # not imported: no process group to abort
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return "no process group"
        backend = str(dist.get_backend())
    except Exception as exc:  # a half-torn-down default group: exiting is all that is left
        return f"process group state unknown ({exc})"
    if "nccl" not in backend:
        return f"{backend}: nothing to abort"
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:
        log.warning("this torch cannot abort NCCL process groups; exiting with them open")
        return "abort unavailable"
    outcome = []

    def run() -> None:
        try:
            abort()
            outcome.append("aborted")
        except Exception as exc:
            outcome.append(f"abort failed: {exc}")

    thread = threading.Thread(target=run, name="trainwarden-nccl-abort", daemon=True)
    thread.start()
    thread.join(timeout_s)
    result = outcome[0] if outcome else f"abort still blocked after {timeout_s:g}s"
    log.info("NCCL process groups: %s", result)
    return result

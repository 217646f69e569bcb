"""Fixed glibc malloc thresholds for the long-lived trainwarden processes (`trainwarden run`, the agent daemon).

glibc serves an allocation of ``M_MMAP_THRESHOLD`` bytes or more (128 KiB at start) with its own ``mmap`` and gives
the pages back when it is freed. But the threshold is dynamic: each time such a chunk is freed, glibc raises the
threshold to its size (up to 32 MiB), so the next buffers of that size come from the heap, and what the heap held
for them stays held after they are freed (the trim threshold rises with it). A long run meets a few large
transient buffers at odd moments: a link check's probe payloads, a hang's diagnostics, the gRPC and etcd buffers
of a quorum loss or a failover. Each left its step in the anonymous RSS of `trainwarden run` in the soak (issue 45:
+11 MB of RssAnon in 27 minutes, flat between faults, file-backed pages flat), while tracemalloc's live objects
stayed flat (BENCHMARKS.md, "Where the launcher's RSS goes").

Setting the thresholds explicitly (``mallopt``) turns the dynamic adjustment off: large buffers are always mapped
and unmapped, and the heap gives back its free top above 128 KiB. Only the process's own allocator is touched:
the workers (the user's processes) are not. ``TRAINWARDEN_MALLOC_TUNING=0`` leaves glibc's defaults; on another C
library it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "tune_malloc"]

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 128 * 1024
"""Bytes from which an allocation is its own mapping (glibc's initial value, now fixed)."""
TRIM_THRESHOLD = 128 * 1024
"""Free bytes at the top of the heap above which glibc returns them (glibc's initial value, now fixed)."""

_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_THRESHOLD = -3
ENV = "TRAINWARDEN_MALLOC_TUNING"


def tune_malloc() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (module docstring); whether they were set. Call once,
    early (the thresholds are process-wide); never raises."""
    if os.environ.get(ENV, "1").strip() == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): their allocators have no such thresholds
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.debug("mallopt refused the mmap or trim threshold; glibc's dynamic thresholds stay")
    return ok

"""Telling a rank's own failure from the echo of a peer's.

When one rank dies, every other rank's next collective fails too ("Connection closed by peer" on gloo,
a DistBackendError/DistNetworkError on NCCL). Those errors are consequences, not causes: logging a full
traceback from each of hundreds of ranks buries the one line that matters. ``peer_failure`` recognises
them so a training loop can log one line and exit, leaving the traceback to the rank that failed first.
"""

from __future__ import annotations

import re

__all__ = ["peer_failure"]

_PEER_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Connection refused",
    "Broken pipe",
    "NCCL communicator was aborted",
    "remote process exited",
)
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*")  # gloo's "[.../pair.cc:553] "
_PEER_TYPES = ("DistNetworkError", "DistBackendError", "DistStoreError")


def peer_failure(exc: BaseException) -> str | None:
    """A one-line description if ``exc`` (or its cause chain) is a lost peer, else None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        if type(current).__name__ in _PEER_TYPES or any(m in text for m in _PEER_MARKERS):
            first = next((line.strip() for line in text.splitlines() if line.strip()), type(current).__name__)
            first = _SOURCE_PREFIX.sub("", first).split(" This is typically")[0]
            return first[:200]
        current = current.__cause__ or current.__context__
    return None

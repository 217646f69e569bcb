"""Telling a rank's own failure from the echo of a peer's.

When one rank dies, every other rank's next collective fails too ("Connection closed by peer" on gloo,
a DistBackendError/DistNetworkError on NCCL). Those errors are consequences, not causes: logging a full
traceback from each of hundreds of ranks buries the one line that matters. ``peer_failure`` recognises
them so a training loop can log one line and exit, leaving the traceback to the rank that failed first.
"""

from __future__ import annotations

import re

from trainwarden.agent.shared.contract import PEER_FAILURE_MARKERS, PEER_FAILURE_TYPES

__all__ = ["peer_failure"]

_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*")  # gloo's "[.../pair.cc:553] "


def peer_failure(exc: BaseException) -> str | None:
    """A one-line description if ``exc`` (or its cause chain) is a lost peer, else None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        if type(current).__name__ in PEER_FAILURE_TYPES or any(m in text for m in PEER_FAILURE_MARKERS):
            first = next((line.strip() for line in text.splitlines() if line.strip()), type(current).__name__)
            first = _SOURCE_PREFIX.sub("", first).split(" This is typically")[0]
            return first[:200]
        current = current.__cause__ or current.__context__
    return None

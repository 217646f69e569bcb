"""Worker rounds that their launcher stops on purpose, which the watchdog must not take for a hang.

A launcher that fences its node (cut off from etcd), stops on a signal or gives up on a configuration error
stops its workers; until they are gone their ranks stall and die, and a fenced node's ranks stalled already,
waiting for peers across the partition. Judged as usual, that reads as a hang of every rank on the node, an
incident beside the one that says what happened. `StandDowns` holds the job's current worker round out of the
hang check from the moment the launcher says so until a new worker round starts (the node rejoining).

The launcher's thread writes, the watchdog's reads: every method takes the lock.
"""

from __future__ import annotations

import threading
from typing import Hashable

__all__ = ["StandDowns"]


class StandDowns:
    """Per job: why its launcher stops the workers, and the worker round that was running then."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, list] = {}  # job -> [why, the round it was said in (None: not seen yet)]

    def add(self, job: str, why: str) -> None:
        with self._lock:
            self._jobs[job] = [why, None]

    def why(self, job: str, round_id: Hashable | None = None) -> str | None:
        """Why the job's current round is not judged, or None. Given the round seen now, the first round seen
        after `add` is the stopped one; any later round ends the stand-down."""
        with self._lock:
            entry = self._jobs.get(job)
            if entry is None or round_id is None:
                return entry[0] if entry else None
            if entry[1] is None:
                entry[1] = round_id
            elif entry[1] != round_id:
                del self._jobs[job]
                return None
            return entry[0]

    def forget(self, job: str) -> None:
        with self._lock:
            self._jobs.pop(job, None)

"""What a stalled job's ranks are doing, read from their processes: the hang check's activity rule (hang.py).

A rank computing, or reading its data, is not hung: `ProcessActivity.read` gives the CPU seconds of each rank's
process tree and the bytes its process moved, where this agent can read them, and the own CPU seconds of the
ranks whose training thread waits inside one call for a collective (`waits`): a CUDA synchronize spins a core,
which is not work. The readers are injected so that unit tests can feed their own numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from trainwarden.agent.telemetry.job_telemetry import RankSnapshot
from trainwarden.agent.watchdog.culprit import process_cpu_seconds, process_io_bytes, process_own_cpu_seconds

__all__ = ["WAITING_AFTER_S", "ProcessActivity", "waits"]

WAITING_AFTER_S = 0.5
"""A rank whose training thread has stayed inside one call this long, with a collective in flight as long, waits
(a GPU rank spins a core in a CUDA synchronize: its own CPU is not work, hang.py)."""


def waits(rank: RankSnapshot) -> bool:
    """The rank's training thread waits inside one call for a collective (``WAITING_AFTER_S``)."""
    return min(rank.still_seconds, rank.collective_pending_seconds) >= WAITING_AFTER_S


@dataclass(frozen=True)
class ProcessActivity:
    io_bytes: Callable[[int], int | None] = process_io_bytes
    cpu_seconds: Callable[[int], float | None] = process_cpu_seconds
    own_cpu_seconds: Callable[[int], float | None] = process_own_cpu_seconds

    def read(self, ranks: Sequence[RankSnapshot]) -> dict[str, dict[int, float]]:
        """``HangDetector.observe``'s ``cpu_seconds``, ``io_bytes`` and ``waiting_cpu_seconds``."""
        cpu, io, waiting = {}, {}, {}
        for r in ranks:
            if r.pid <= 0:
                continue
            seconds, moved = self.cpu_seconds(r.pid), self.io_bytes(r.pid)
            if seconds is not None:
                cpu[r.rank] = seconds
                own = self.own_cpu_seconds(r.pid) if waits(r) else None
                if own is not None:
                    waiting[r.rank] = own
            if moved is not None:
                io[r.rank] = moved
        return {"cpu_seconds": cpu, "io_bytes": io, "waiting_cpu_seconds": waiting}

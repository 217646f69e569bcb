"""Publishing committed checkpoints: rank 0 reports a commit with its path over telemetry, and the node
agent makes it the job's latest in etcd (``jobs/<job>/checkpoint``). Workers hold no etcd client.

A ``TelemetryListener``: it hears of the commit on the telemetry reader's thread and queues the write on the
node's ``EtcdWriter`` (agent/etcd/writer.py), so a slow or absent etcd never holds up telemetry; the write
lands when etcd is back. The ``latest`` file beside the checkpoints stays the truth for restore.
"""

from __future__ import annotations

import logging
import time

from trainwarden.agent.etcd.job_records import JobRecords

logger = logging.getLogger(__name__)

__all__ = ["CheckpointPublisher"]


class CheckpointPublisher:
    def __init__(self, records: JobRecords, *, wall=time.time) -> None:
        self._records, self._wall = records, wall

    def on_step(self, job: str, rank: int, pid: int, index: int, start_unix: float, duration_s: float) -> None:
        pass

    def on_checkpoint(self, job: str, rank: int, stage: str, step: int, path: str, nbytes: int,
                      detail: str = "", seconds: float = 0.0) -> None:
        if stage != "committed" or not path:
            return
        self._records.put_checkpoint(job, {"step": step, "path": path, "time": self._wall(), "bytes": nbytes})

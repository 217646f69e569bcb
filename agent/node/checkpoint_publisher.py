"""Publishing committed checkpoints: rank 0 reports a commit with its path over telemetry, and the node
agent makes it the job's latest in etcd (``jobs/<job>/checkpoint``). Workers hold no etcd client.

A ``TelemetryListener``: it hears of the commit on the telemetry reader's thread and hands the write to
one thread of its own, so a slow or absent etcd never holds up telemetry. An etcd that does not answer
is logged; the ``latest`` file beside the checkpoints stays the truth for restore.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from trainwarden.agent.etcd.job_records import EtcdUnavailable, JobRecords

logger = logging.getLogger(__name__)

__all__ = ["CheckpointPublisher"]


class CheckpointPublisher:
    def __init__(self, records: JobRecords, *, wall=time.time) -> None:
        self._records, self._wall = records, wall
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="trainwarden-publish")

    def on_step(self, job: str, rank: int, pid: int, index: int, start_unix: float, duration_s: float) -> None:
        pass

    def on_checkpoint(self, job: str, rank: int, stage: str, step: int, path: str, nbytes: int) -> None:
        if stage != "committed" or not path:
            return
        info = {"step": step, "path": path, "time": self._wall(), "bytes": nbytes}
        try:
            self._pool.submit(self._put, job, info)
        except RuntimeError:  # stopping
            pass

    def _put(self, job: str, info: dict) -> None:
        try:
            self._records.put_checkpoint(job, info)
        except EtcdUnavailable as exc:
            logger.warning("could not publish checkpoint step %s of job %s: %s", info["step"], job, exc)

    def stop(self) -> None:
        """Finish the writes already handed over, then stop."""
        self._pool.shutdown(wait=True)

"""Publishing a committed checkpoint as the job's latest in etcd (``jobs/<job>/checkpoint``).

Rank 0's ``Checkpointer`` calls ``CheckpointPublisher`` from its commit thread, never from the step.
The etcd endpoint and the job come from the launcher's environment (``TRAINWARDEN_ETCD_ENDPOINT``,
``TRAINWARDEN_JOB``); without them publishing is off. An unreachable etcd is logged and skipped: the
atomic ``latest`` file next to the checkpoints stays the source of truth for restore, the etcd key is
what operators and other nodes read.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Mapping

logger = logging.getLogger(__name__)

__all__ = ["CheckpointPublisher"]


class CheckpointPublisher:
    def __init__(self, *, job: str | None, endpoint: str | None, store_factory=None) -> None:
        self.job, self.endpoint = job, endpoint
        self._store_factory = store_factory
        self._store = None
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "CheckpointPublisher":
        env = os.environ if env is None else env
        return cls(job=env.get("TRAINWARDEN_JOB") or None, endpoint=env.get("TRAINWARDEN_ETCD_ENDPOINT") or None)

    @property
    def enabled(self) -> bool:
        return bool(self.job and self.endpoint)

    def __call__(self, info) -> None:
        if not self.enabled:
            return
        with self._lock:
            try:
                if self._store is None:
                    self._store = self._connect()
                self._store.put_checkpoint(self.job, info.to_json())
            except Exception as exc:  # the checkpoint is committed on disk whatever etcd says
                self._store = None
                logger.warning("could not publish checkpoint step %s to etcd at %s: %s", info.step,
                               self.endpoint, exc)

    def _connect(self):
        if self._store_factory is not None:
            return self._store_factory()
        from trainwarden.agent.etcd.job_records import JobStore, connect

        return JobStore(connect(self.endpoint, timeout=5.0), endpoint=self.endpoint)

"""Writes to etcd that never stall the caller: a bounded queue, one writer thread, retries until etcd is back.

The supervisor's phase changes, incident copies, exclusion requests and checkpoint pointers are written from
threads that must not wait for etcd: the output pump (a blocked pump blocks torchrun's stdout and then the
workers' logging), the watchdog (an abort must not wait 10 s for an incident copy), the telemetry reader.
``EtcdWriter.put``/``delete`` only queue; a thread writes, in order, and retries with back-off while etcd is
away. Writes to one key coalesce (the newest value wins, at the key's latest place in the order), so an
outage queues at most one write per key; when the queue is full anyway the oldest write is dropped and
counted. An outage is one log line when it starts and one when etcd is back, and ``stats()`` for metrics
(``trainwarden_etcd_writes_pending``, ``..._failures_total``, ``..._dropped_total``, ``trainwarden_etcd_up``).
``flush(timeout)`` waits for the queue to drain (before exiting, say).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from trainwarden.agent.etcd.client import describe_etcd_error

logger = logging.getLogger(__name__)

__all__ = ["EtcdWriter"]

_DELETE = object()


class EtcdWriter:
    """See the module docstring. ``client`` is an etcd3 client (or a fake with ``put`` and ``delete``)."""

    def __init__(self, client, *, endpoint: str = "etcd", max_pending: int = 10_000, node: str = "",
                 backoff_initial_s: float = 0.1, backoff_max_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client, self._endpoint, self._node = client, endpoint, node
        self._max_pending = max_pending
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._clock = clock
        self._pending: OrderedDict[str, object] = OrderedDict()
        self._cond = threading.Condition()
        self._busy = False
        self._stopping = False
        self.failures = 0
        self.dropped = 0
        self.written = 0
        self.up = True
        self._down_since: float | None = None
        self._thread = threading.Thread(target=self._run, name="trainwarden-etcd-writer", daemon=True)
        self._thread.start()

    @property
    def client(self):
        """The etcd client the writes go through (for the few reads an agent makes, e.g. a job's checkpoint
        record when a worker asks before a restore)."""
        return self._client

    # ---- callers' side: never blocks ---------------------------------------------------------------

    def put(self, key: str, value: str | bytes) -> None:
        self._queue(key, value)

    def delete(self, key: str) -> None:
        self._queue(key, _DELETE)

    def _queue(self, key: str, value: object) -> None:
        with self._cond:
            self._pending.pop(key, None)
            self._pending[key] = value
            while len(self._pending) > self._max_pending:
                dropped, _ = self._pending.popitem(last=False)
                self.dropped += 1
                logger.warning("etcd write queue full (%d): dropped the write of %s", self._max_pending, dropped)
            self._cond.notify()

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds until every queued write is done; True when they are."""
        deadline = self._clock() + timeout
        with self._cond:
            while self._pending or self._busy:
                left = deadline - self._clock()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def stop(self, timeout: float = 2.0) -> None:
        """Try to write what is queued for up to `timeout` seconds, then stop the thread."""
        self.flush(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(1.0)
        if self._pending:
            logger.warning("stopping with %d etcd write(s) not done (etcd at %s unreachable)", len(self._pending),
                           self._endpoint)

    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    # ---- the writer thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        delay = self._backoff[0]
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                key, value = next(iter(self._pending.items()))
                self._busy = True
            try:
                if value is _DELETE:
                    self._client.delete(key)
                else:
                    self._client.put(key, value)
            except Exception as exc:  # etcd away (or refusing): keep it queued and try again later
                with self._cond:
                    self._busy = False
                    self.failures += 1
                self._went_down(exc)
                with self._cond:
                    self._cond.wait(delay)
                delay = min(delay * 2, self._backoff[1])
                continue
            delay = self._backoff[0]
            with self._cond:
                if self._pending.get(key) is value:  # not replaced by a newer write meanwhile
                    del self._pending[key]
                self._busy = False
                self.written += 1
                left = len(self._pending)
                self._cond.notify_all()
            self._came_back(left)

    def _went_down(self, exc: BaseException) -> None:
        if self.up:
            self.up, self._down_since = False, self._clock()
            logger.warning("etcd at %s does not take writes (%s); %d write(s) queued, training goes on and they "
                           "are retried until it is back", self._endpoint, describe_etcd_error(exc), self.pending())

    def _came_back(self, left: int) -> None:
        if not self.up:
            down = self._clock() - (self._down_since or self._clock())
            self.up = True
            logger.warning("etcd at %s takes writes again after %.0f s; %d write(s) still queued", self._endpoint,
                           down, left)

    # ---- metrics -------------------------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        labels = ["node"]
        up = GaugeMetricFamily("trainwarden_etcd_up", "1 while etcd takes the agent's writes.", labels=labels)
        up.add_metric([self._node], 1.0 if self.up else 0.0)
        pending = GaugeMetricFamily("trainwarden_etcd_writes_pending", "etcd writes queued, waiting for etcd.",
                                    labels=labels)
        pending.add_metric([self._node], self.pending())
        failures = CounterMetricFamily("trainwarden_etcd_write_failures", "etcd write attempts that failed "
                                       "(each is retried).", labels=labels)
        failures.add_metric([self._node], self.failures)
        dropped = CounterMetricFamily("trainwarden_etcd_writes_dropped", "etcd writes dropped because the queue "
                                      "was full.", labels=labels)
        dropped.add_metric([self._node], self.dropped)
        yield from (up, pending, failures, dropped)

"""A c10d ``Store`` kept in etcd through the v3 API: the store half of the ``etcd3`` rendezvous.

torchrun's dynamic rendezvous needs two things from a backend: a place for the rendezvous state
(``Etcd3RendezvousBackend`` in ``rendezvous.py``) and a c10d ``Store`` through which the agents of one
round exchange small values: rank 0 publishes ``MASTER_ADDR``/``MASTER_PORT`` (``RendezvousStoreInfo``),
and the agents meet in barriers (``torch.distributed.elastic.utils.store.barrier``: ``add`` + ``wait``).
torch's own ``EtcdStore`` does this on the v2 API, which etcd 3.6 removed; this is the same store on v3.

Design:

* Keys live under one prefix, ``<key_prefix>/rdzv/<run_id>/store/``, and are stored verbatim (v3 keys
  and values are arbitrary bytes, so no base64 as in the v2 store). The handler wraps the store in a
  ``PrefixStore`` per round (``torch.rendezvous.<run_id>.<round>/``), so rounds never see each
  other's values.
* Blocking reads (``get``, ``wait``) poll with a capped exponential back-off (10 ms doubling to
  250 ms) until every key is present or the store's timeout passes; they ride out an etcd restart.
  Polling instead of an etcd watch keeps the store stateless: no watch stream to re-establish after
  an etcd restart, no thread. The waits it serves are short (a rendezvous round, an exit barrier) and
  few (one per agent), so the extra reads cost etcd little. Several keys are read in one
  transaction, i.e. one consistent snapshot per poll.
* ``add`` and ``compare_set`` are atomic through etcd transactions: compare the key's
  ``mod_revision`` (or value), write only if unchanged, retry ``add`` on contention.
* Errors use torch's types so c10d callers handle them as they handle ``TCPStore``'s: a timeout raises
  ``DistStoreError`` (what ``barrier`` catches), an etcd that cannot be reached raises
  ``DistNetworkError`` naming the endpoint.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import etcd3
from torch.distributed import DistNetworkError, DistStoreError, Store

from trainwarden.agent.etcd.client import ETCD_CLIENT_ERRORS, describe_etcd_error, with_failover

logger = logging.getLogger(__name__)

__all__ = ["Etcd3Store"]

_POLL_FIRST_S = 0.01
_POLL_MAX_S = 0.25
_T = TypeVar("_T")


def _to_bytes(value: str | bytes) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    raise TypeError(f"store keys and values must be str or bytes, not {type(value).__name__}")


class Etcd3Store(Store):
    """c10d ``Store`` whose keys live in etcd under ``prefix``.

    Args:
        client: a connected ``etcd3`` client (see ``rendezvous.connect``).
        prefix: the key prefix, e.g. ``/trainwarden/v1/rdzv/JOB/store``; a trailing ``/`` is added.
        endpoint: ``host:port`` of etcd, only used in error messages.
        timeout: how long ``get`` and ``wait`` block; the c10d default (300 s) when ``None``.
        clock, sleep: injectable for tests.
    """

    def __init__(
        self,
        client: etcd3.MultiEndpointEtcd3Client,
        prefix: str,
        *,
        endpoint: str = "etcd",
        timeout: timedelta | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__()  # required by the pybind trampoline
        if not prefix:
            raise ValueError("the etcd store needs a non-empty key prefix, e.g. /trainwarden/v1/rdzv/JOB/store")
        self._client = client
        self._prefix = _to_bytes(prefix.rstrip("/") + "/")
        self._endpoint = endpoint
        self._clock = clock
        self._sleep = sleep
        if timeout is not None:
            self.set_timeout(timeout)

    @property
    def prefix(self) -> str:
        return self._prefix.decode()

    # -- c10d Store API -------------------------------------------------------------------------

    def set(self, key: str | bytes, value: str | bytes) -> None:
        self._call("set", lambda: self._client.put(self._key(key), _to_bytes(value)))

    def get(self, key: str | bytes) -> bytes:
        """Return the value of ``key``, blocking up to the store's timeout until it is set."""
        values = self._wait_for([key], self.timeout)
        if values is None:
            raise DistStoreError(
                f"key {key!r} was not set in the etcd store {self.prefix} at {self._endpoint} within "
                f"{self.timeout.total_seconds():.0f}s; a peer that should have set it has not joined"
            )
        return values[0]

    def wait(self, keys: Sequence[str | bytes], timeout: timedelta | None = None) -> None:
        """Block until every key is set; ``DistStoreError`` after ``timeout`` (default: the store's)."""
        timeout = self.timeout if timeout is None else timeout
        if self._wait_for(keys, timeout) is None:
            missing = [k for k, v in zip(keys, self._read(keys)) if v is None]
            raise DistStoreError(
                f"keys {missing!r} were not set in the etcd store {self.prefix} at {self._endpoint} "
                f"within {timeout.total_seconds():.3g}s"
            )

    def check(self, keys: Sequence[str | bytes]) -> bool:
        """True when every key is set right now (no waiting)."""
        return all(v is not None for v in self._read(keys))

    def add(self, key: str | bytes, amount: int) -> int:
        """Atomically add ``amount`` to the decimal integer at ``key`` (0 when absent); return the sum."""
        full_key = self._key(key)
        tx = self._client.transactions
        delay = _POLL_FIRST_S
        while True:
            value, meta = self._call("add", lambda: self._client.get(full_key))
            if value is None:
                current, guard = 0, tx.version(full_key) == 0
            else:
                try:
                    current = int(value)
                except ValueError:
                    raise DistStoreError(
                        f"add({key!r}): the stored value {value[:40]!r} is not a decimal integer"
                    ) from None
                guard = tx.mod(full_key) == meta.mod_revision
            new = current + int(amount)
            ok, _ = self._call(
                "add",
                lambda: self._client.transaction(
                    compare=[guard], success=[tx.put(full_key, str(new).encode())], failure=[]
                ),
            )
            if ok:
                return new
            self._sleep(random.uniform(0, delay))  # contention: another agent won; spread retries
            delay = min(delay * 2, _POLL_MAX_S)

    def compare_set(self, key: str | bytes, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value``; return the value it holds after.

        c10d semantics (as ``TCPStore``): an absent key counts as holding ``b""``; when it is absent and
        ``expected_value`` is not empty, nothing is written and ``expected_value`` is returned.
        """
        full_key = self._key(key)
        expected, desired = _to_bytes(expected_value), _to_bytes(desired_value)
        tx = self._client.transactions
        while True:
            ok, responses = self._call(
                "compare_set",
                lambda: self._client.transaction(
                    compare=[tx.value(full_key) == expected],
                    success=[tx.put(full_key, desired)],
                    failure=[tx.get(full_key)],
                ),
            )
            if ok:
                return desired
            if responses and responses[0]:
                return responses[0][0][0]  # present with another value
            if expected:
                return expected  # absent, and the caller expected a value
            ok, _ = self._call(
                "compare_set",
                lambda: self._client.transaction(
                    compare=[tx.version(full_key) == 0], success=[tx.put(full_key, desired)], failure=[]
                ),
            )
            if ok:
                return desired
            # created concurrently: compare against what is there now

    def delete_key(self, key: str | bytes) -> bool:
        return bool(self._call("delete_key", lambda: self._client.delete(self._key(key))))

    def num_keys(self) -> int:
        response = self._call(
            "num_keys", lambda: self._client.get_prefix_response(self._prefix, count_only=True)
        )
        return int(response.count)

    # -- helpers ----------------------------------------------------------------------------------

    def _key(self, key: str | bytes) -> bytes:
        return self._prefix + _to_bytes(key)

    def _read(self, keys: Sequence[str | bytes]) -> list[bytes | None]:
        """Values of ``keys`` (``None`` where absent), read in one transaction: one snapshot."""
        tx = self._client.transactions
        gets = [tx.get(self._key(k)) for k in keys]
        _, responses = self._call("read", lambda: self._client.transaction(compare=[], success=gets, failure=[]))
        return [kvs[0][0] if kvs else None for kvs in responses]

    def _wait_for(self, keys: Sequence[str | bytes], timeout: timedelta) -> list[bytes] | None:
        """All values once every key is set; ``None`` at the deadline.

        etcd being unreachable for a while (a restart) does not end the wait early: polling goes on
        until the deadline, and only then is the last ``DistNetworkError`` raised.
        """
        deadline = self._clock() + max(timeout.total_seconds(), 0.0)
        delay = _POLL_FIRST_S
        while True:
            try:
                values = self._read(keys)
            except DistNetworkError as exc:
                if self._clock() >= deadline:
                    raise
                logger.debug("etcd store wait: %s; retrying until the deadline", exc)
                values = [None]
            if all(v is not None for v in values):
                return values  # type: ignore[return-value]
            remaining = deadline - self._clock()
            if remaining <= 0:
                return None
            self._sleep(min(delay, remaining))
            delay = min(delay * 2, _POLL_MAX_S)

    def _call(self, what: str, op: Callable[[], _T]) -> _T:
        try:
            return with_failover(self._client, op)
        except ETCD_CLIENT_ERRORS as exc:
            raise DistNetworkError(
                f"etcd store {what} failed at {self._endpoint}: {describe_etcd_error(exc)}; "
                "check that etcd is running and reachable from this node"
            ) from exc

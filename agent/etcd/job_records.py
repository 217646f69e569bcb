"""The job keys in etcd (DESIGN.md "etcd keys"): spec, state and the latest checkpoint pointer.

Values are JSON. The client is a constructor parameter (an ``etcd3`` client, or a fake in tests),
and every call is wrapped so that an unreachable etcd raises ``EtcdUnavailable`` with the
endpoint in the message instead of a raw gRPC error.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from trainwarden.agent.etcd.client import (EtcdAccessDenied, EtcdConfig, EtcdUnavailable, describe_etcd_error,
                                          is_auth_error, open_etcd)
from trainwarden.agent.etcd.keys import DEFAULT_PREFIX, PROBE_KEY, job_key, rdzv_key

logger = logging.getLogger(__name__)

__all__ = ["EtcdAccessDenied", "EtcdUnavailable", "JobRecords", "connect"]


def connect(etcd: "str | EtcdConfig", *, timeout: float = 5.0,
            hint: str = "check that etcd runs there and that --etcd (or $TRAINWARDEN_ETCD) names it"):
    """An etcd client for ``etcd`` (``[http[s]://]host:port``, or settings with TLS and auth), checked to
    answer; ``EtcdUnavailable`` (ending with ``hint``: what to do) if it does not, ``EtcdAccessDenied`` if it
    refuses the credentials."""
    config = etcd if isinstance(etcd, EtcdConfig) else \
        EtcdConfig(endpoints=(etcd,), timeout=timeout, connect_timeout=min(timeout, 2.0))
    try:
        client = open_etcd(config)
    except EtcdAccessDenied:
        raise
    except Exception as exc:
        raise EtcdUnavailable(
            f"cannot reach etcd at {config.describe()} ({type(exc).__name__}); {hint}") from exc
    try:
        client.get(f"{DEFAULT_PREFIX}/{PROBE_KEY}")
    except Exception as exc:
        client.close()
        if is_auth_error(exc):
            raise EtcdAccessDenied(f"etcd at {config.describe()} refused to serve user {config.user!r}: "
                                   f"{describe_etcd_error(exc)}; grant it read/write on {DEFAULT_PREFIX}/") from exc
        raise EtcdUnavailable(f"cannot reach etcd at {config.describe()} ({type(exc).__name__}); {hint}") from exc
    return client



class JobRecords:
    """A job's records in etcd: ``jobs/<job>/spec``, ``state`` and ``checkpoint`` (JSON values).

    Reads and ``put_spec`` go to etcd at once (start-up must know that etcd answers); with a ``writer``
    (agent/etcd/writer.py), ``put_state`` and ``put_checkpoint`` are queued and never wait for etcd: they are
    called from threads that must not stall (the output pump, the telemetry reader)."""

    def __init__(self, client, *, prefix: str = DEFAULT_PREFIX, endpoint: str = "etcd", writer=None) -> None:
        self._client = client
        self._writer = writer
        self._prefix = prefix.rstrip("/")
        self._endpoint = endpoint

    def key(self, job: str, *parts: str) -> str:
        return job_key(job, *parts, prefix=self._prefix)

    def _put(self, key: str, value: dict[str, Any]) -> None:
        try:
            self._client.put(key, json.dumps(value, sort_keys=True))
        except Exception as exc:
            raise EtcdUnavailable(f"cannot write {key} to etcd at {self._endpoint}: {exc}") from exc

    def _get(self, key: str) -> dict[str, Any] | None:
        try:
            value, _ = self._client.get(key)
        except Exception as exc:
            raise EtcdUnavailable(f"cannot read {key} from etcd at {self._endpoint}: {exc}") from exc
        if value is None:
            return None
        try:
            return json.loads(value)
        except ValueError:
            logger.error("etcd key %s holds invalid JSON; ignoring it", key)
            return None

    def put_spec(self, job: str, spec: dict[str, Any]) -> None:
        self._put(self.key(job, "spec"), spec)

    def put_state(self, job: str, state: dict[str, Any]) -> None:
        self._put_later(self.key(job, "state"), state)

    def put_checkpoint(self, job: str, info: dict[str, Any]) -> None:
        self._put_later(self.key(job, "checkpoint"), info)

    def _put_later(self, key: str, value: dict[str, Any]) -> None:
        if self._writer is None:
            self._put(key, value)
        else:
            self._writer.put(key, json.dumps(value, sort_keys=True))

    def reset_rendezvous(self, job: str) -> None:
        """Delete a finished generation's rendezvous and store keys: a closed rendezvous cannot be rejoined."""
        try:
            self._client.delete_prefix(rdzv_key(job, prefix=self._prefix) + "/")
        except Exception as exc:
            raise EtcdUnavailable(f"cannot reset the rendezvous of {job} in etcd at {self._endpoint}: {exc}") from exc

    def get_state(self, job: str) -> dict[str, Any] | None:
        return self._get(self.key(job, "state"))

    def get_checkpoint(self, job: str) -> dict[str, Any] | None:
        return self._get(self.key(job, "checkpoint"))

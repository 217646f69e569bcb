"""This node's record in etcd, ``nodes/<node>``: what `trainwarden nodes` lists, under a lease that says it lives.

The record (host, address, version, GPUs, health, endpoints, the jobs whose launcher runs here) is put only when it
changes (a job started or ended here, a cordon), not every round; otherwise only its lease is kept alive, every
``NODE_RECORD_KEEPALIVE_S``. A lease that lapsed (etcd was away) took the record with it: the record is put again
under a fresh one. A daemon gone ``NODE_RECORD_TTL_S`` drops out.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Callable, Mapping

from trainwarden.agent import __version__
from trainwarden.agent.etcd.client import describe_etcd_error, refresh_lease, with_failover
from trainwarden.agent.etcd.jobs import JobControl

logger = logging.getLogger(__name__)

__all__ = ["NODE_RECORD_KEEPALIVE_S", "NODE_RECORD_TTL_S", "NodeRecord"]

NODE_RECORD_TTL_S = 15
"""Lease of ``nodes/<node>``: a daemon gone this long drops out of `trainwarden nodes`."""
NODE_RECORD_KEEPALIVE_S = NODE_RECORD_TTL_S / 3
"""How often the node record's lease is kept alive: three tries before it lapses. The record itself is put only when
it changes (a job started or ended here, a cordon), not every round: the keep-alive is what says the node lives."""


class NodeRecord:
    """Puts ``nodes/<node>`` when it changed and keeps its lease alive otherwise (module docstring)."""

    def __init__(self, client, control: JobControl, *, node: str, address: str | None, endpoints: dict,
                 gpus: Callable[[], int] | None, clock: Callable[[], float]) -> None:
        self._client, self._control, self._node = client, control, node
        self._address, self._endpoints, self._gpus, self._clock = address or "", endpoints, gpus, clock
        self._lease = None
        self._lease_at: float | None = None  # monotonic time of the record's last put or keep-alive
        self._written: dict | None = None  # the record last put (without its time)

    def publish(self, cordon: dict | None, launchers: Mapping) -> bool:
        """The record for this round (``launchers``: job -> its LauncherRecord); False when etcd could not be
        written (the caller then reads the jobs again: the watches likely died with the connection)."""
        client = self._client
        record = {"node": self._node, "host": socket.gethostname(), "address": self._address,
                  "version": __version__, "pid": os.getpid(),
                  "gpus": self._gpus() if self._gpus else 0,
                  "health": ("draining" if launchers else "drained") if cordon and cordon.get("drain")
                  else "cordoned" if cordon else "ok",
                  "endpoints": self._endpoints,
                  "jobs": {job: {"pid": rec.pid, "generation": rec.generation} for job, rec in launchers.items()}}
        key = self._control.node_key(self._node)
        now = self._clock()
        try:
            if self._lease is not None and record == self._written:
                if self._lease_at is not None and now - self._lease_at < NODE_RECORD_KEEPALIVE_S:
                    return True
                if refresh_lease(client, self._lease):
                    self._lease_at = now
                    return True
                self._lease = None  # it lapsed (etcd was away): the record went with it
            if self._lease is None:
                self._lease = with_failover(client, lambda: client.lease(NODE_RECORD_TTL_S))
            value = json.dumps({**record, "at": time.time()}, sort_keys=True)
            with_failover(client, lambda: client.put(key, value, lease=self._lease))
            self._written, self._lease_at = record, now
            return True
        except Exception as exc:
            self._lease, self._written = None, None
            logger.debug("cannot write the node record: %s", describe_etcd_error(exc))
            return False

    def revoke(self) -> None:
        """The record goes now, not when its lease expires (the daemon stops)."""
        if self._lease is not None:
            try:
                self._lease.revoke()
            except Exception:  # it expires by itself
                pass

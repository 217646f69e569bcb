"""A node's membership in a job: ``jobs/<job>/nodes/<node>`` under a lease of its own.

Every node that runs a job (one `trainwarden run` per node, as torchrun is run per node) holds one record:
who supervises the job there (host, pid, start time), the address it advertises, its ranks and its phase.
The record is bound to an etcd lease that the node keeps alive, so a node that dies or loses etcd for longer
than the lease's TTL disappears from the job by itself; nobody has to clean up after a power loss.

Admission (``admit``) runs under the job's claim lock (an etcd lock, so two nodes starting at once are
ordered):

- a live record of the *same* node name is another run of this node: refused, unless it is on this host
  and its supervisor is gone (killed hard; its lease has not expired yet), in which case it is replaced;
- records of *other* nodes that are live: the job is running or starting; this node joins it, with the job's
  current generation, and its rendezvous is left alone;
- no live record: this node starts the job (again): the caller bumps the generation and resets the
  rendezvous of the finished generation (a closed torch rendezvous cannot be rejoined).

``NodeMembership`` keeps the lease alive on a thread of its own and re-puts the record when it changes
(``update``); callers never wait for etcd. If etcd is away long enough for the lease to expire, the record
is written again under a new lease when etcd is back (the node is still running the job), and
``lost_since`` says since when the node could not confirm its membership (the fencing input).

A node that leaves on purpose (``stop``) first writes ``jobs/<job>/departed/<node>`` (short lease); a record
that vanishes without it is a lost node. The survivors that notice race for
``jobs/<job>/lost/<node>/<create revision>`` (``claim_node_loss``): one of them records the incident
(agent/incidents/node_loss.py).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from trainwarden.agent.common.job_lifecycle import supervisor_gone
from trainwarden.agent.etcd.client import describe_etcd_error, read_json_prefix, refresh_lease, with_failover
from trainwarden.agent.etcd.keys import DEFAULT_PREFIX, job_key

logger = logging.getLogger(__name__)

__all__ = ["Admission", "MEMBERSHIP_TTL_S", "NodeMembership", "NodeTaken", "admit", "claim_node_loss", "departed",
           "live_nodes", "mark_departed", "member_records", "should_fence"]

MEMBERSHIP_TTL_S = 10
"""Lease TTL of a node record: how long a dead node stays listed (and how long etcd may be away before a
live node's record lapses and is written again)."""

CLAIM_LOCK_TTL_S = 30
"""A claim lock whose holder died frees itself after this long."""


def should_fence(*, unconfirmed_s: float, ttl_s: float, median_step_s: float | None,
                 since_last_step_s: float | None) -> bool:
    """Whether a node of a multi-node job must stop its workers because it lost etcd.

    Its record lapsed (etcd unconfirmed for longer than the lease, and for three of the job's median steps, so
    a job of long steps is not fenced between two of them) and its workers have completed no step for as
    long (None: none since they started). The second condition tells a node cut off from the others, whose
    round they have left (its collectives cannot complete), from an etcd outage that every node sees: then
    all the nodes still train together, and stopping them would turn etcd's absence into a lost job."""
    patience = max(ttl_s, 3 * (median_step_s or 0.0))
    return unconfirmed_s > patience and (since_last_step_s is None or since_last_step_s > patience)


class NodeTaken(RuntimeError):
    """Another live run already holds this node's record in the job (not retryable as is)."""


@dataclass(frozen=True)
class Admission:
    """What ``admit`` decided."""

    starts_job: bool
    """No other node is live: this node starts (a new generation of) the job."""
    peers: dict[str, dict]
    """Live records of the other nodes, by node name."""
    replaced: dict | None = None
    """A stale record of this node (its supervisor gone) that was removed."""


def nodes_prefix(job: str, prefix: str = DEFAULT_PREFIX) -> str:
    return job_key(job, "nodes", "", prefix=prefix)


def live_nodes(client, job: str, *, prefix: str = DEFAULT_PREFIX) -> dict[str, dict]:
    """The job's node records in etcd (they exist only while their lease lives), by node name."""
    nodes = {}
    for name, record in read_json_prefix(client, nodes_prefix(job, prefix)).items():
        if record is None:
            logger.error("etcd key %s%s holds invalid JSON; treating the node as live", nodes_prefix(job, prefix), name)
        nodes[name] = record or {}
    return nodes


DEPARTED_TTL_S = 60
"""How long a node that left on purpose stays marked as departed: longer than any survivor's poll."""
NODE_LOSS_TTL_S = 300
"""How long the claim on a lost node's incident stays: every survivor notices the loss well within it."""


def mark_departed(client, job: str, node: str, *, prefix: str = DEFAULT_PREFIX) -> None:
    """Say ``node`` leaves the job on purpose (its record is about to go): the others record no loss."""
    lease = with_failover(client, lambda: client.lease(DEPARTED_TTL_S))
    with_failover(client, lambda: client.put(job_key(job, "departed", node, prefix=prefix), "1", lease=lease))


def departed(client, job: str, node: str, *, prefix: str = DEFAULT_PREFIX) -> bool:
    value, _ = with_failover(client, lambda: client.get(job_key(job, "departed", node, prefix=prefix)))
    return value is not None


def claim_node_loss(client, job: str, node: str, membership: str, claimant: str, *,
                    prefix: str = DEFAULT_PREFIX) -> bool:
    """True for the one survivor that records the loss of ``node``'s membership ``membership`` (the record's
    create revision: the same node lost again after it rejoined is a new loss)."""
    key = job_key(job, "lost", node, membership, prefix=prefix)
    lease = with_failover(client, lambda: client.lease(NODE_LOSS_TTL_S))
    won, _ = with_failover(client, lambda: client.transaction(
        compare=[client.transactions.version(key) == 0],
        success=[client.transactions.put(key, claimant, lease=lease)], failure=[]))
    return bool(won)


def member_records(client, job: str, *, prefix: str = DEFAULT_PREFIX) -> dict[str, tuple[dict, str]]:
    """The job's live node records with each one's create revision (which membership it is), by node."""
    base = nodes_prefix(job, prefix)
    found = {}
    for value, meta in with_failover(client, lambda: list(client.get_prefix(base))):
        name = meta.key.decode()[len(base):]
        try:
            record = json.loads(value)
        except (TypeError, ValueError):
            record = {}
        found[name] = (record if isinstance(record, dict) else {}, str(meta.create_revision))
    return found


def _stale(record: dict, host: str) -> bool:
    """A record whose supervisor ran on this host and is gone: its lease just has not expired yet."""
    return supervisor_gone(record.get("owner") or {}, host=host)


def admit(client, job: str, node: str, *, host: str | None = None, prefix: str = DEFAULT_PREFIX,
          lock_timeout: float = 30.0) -> tuple[Admission, Callable[[], None]]:
    """Decide how ``node`` enters ``job`` (see the module docstring), holding the job's claim lock.

    Returns the decision and the function that releases the lock: the caller registers its own record
    (``NodeMembership.start``) and resets the rendezvous *before* releasing it, so the next node admitted
    sees this one. Raises ``NodeTaken`` when a live run holds ``node`` already, ``TimeoutError`` when the lock
    is not granted within ``lock_timeout``.
    """
    host = host or socket.gethostname()
    lock = _ClaimLock(client, job_key(job, "claim", prefix=prefix))
    if not lock.acquire(lock_timeout):
        raise TimeoutError(f"the claim lock of job {job} was not granted within {lock_timeout:.0f} s")
    try:
        peers = live_nodes(client, job, prefix=prefix)
        replaced = None
        for name, record in list(peers.items()):
            if not _stale(record, host):
                continue
            logger.warning("node %s of job %s was left by a trainwarden run that is gone (%s); removing its record",
                           name, job, record.get("owner"))
            with_failover(client, lambda n=name: client.delete(nodes_prefix(job, prefix) + n))
            del peers[name]
            if name == node:
                replaced = record
        mine = peers.pop(node, None)
        if mine is not None:
            owner = mine.get("owner") or {}
            raise NodeTaken(f"node {node} already runs job {job} (trainwarden run pid {owner.get('pid', '?')} on "
                            f"{owner.get('host', '?')}); stop that run, give this one another --node, or wait "
                            f"{MEMBERSHIP_TTL_S} s for a dead run's record to expire")
    except BaseException:
        _release(lock)
        raise
    return Admission(starts_job=not peers, peers=peers, replaced=replaced), lambda: _release(lock)


def _release(lock: "_ClaimLock") -> None:
    try:
        lock.release()
    except Exception as exc:  # the lock's own lease expires anyway
        logger.warning("cannot release the claim lock: %s", describe_etcd_error(exc))


class _ClaimLock:
    """A mutex as one key under the job's own prefix (python-etcd3's ``lock`` keeps its keys under
    ``/locks/``, which a user granted only the trainwarden prefix may not write): created if absent, in one
    transaction, under a lease so that a holder that dies frees it."""

    def __init__(self, client, key: str) -> None:
        self._client, self._key, self._lease = client, key, None

    def acquire(self, timeout: float) -> bool:
        client, deadline = self._client, time.monotonic() + timeout
        self._lease = with_failover(client, lambda: client.lease(CLAIM_LOCK_TTL_S))
        value = json.dumps({"host": socket.gethostname(), "pid": os.getpid()})
        while True:
            won, _ = with_failover(client, lambda: client.transaction(
                compare=[client.transactions.version(self._key) == 0],
                success=[client.transactions.put(self._key, value, lease=self._lease)], failure=[]))
            if won:
                return True
            if time.monotonic() >= deadline:
                self._lease.revoke()
                return False
            time.sleep(0.2)

    def release(self) -> None:
        self._lease.revoke()  # deletes the key


class NodeMembership:
    """This node's record in the job, kept alive under a lease (module docstring)."""

    def __init__(self, client, job: str, node: str, record: dict[str, Any], *, ttl: int = MEMBERSHIP_TTL_S,
                 prefix: str = DEFAULT_PREFIX, clock: Callable[[], float] = time.monotonic) -> None:
        self._client, self.job, self.node, self._prefix = client, job, node, prefix
        self.key = nodes_prefix(job, prefix) + node
        self._record = dict(record)
        self._ttl = ttl
        self._clock = clock
        self._lease = None
        self._dirty = False
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.confirmed_at: float | None = None
        """When etcd last confirmed the record (monotonic); None before the first write."""

    # ---- the caller's side: start waits for etcd once, the rest never --------------------------------

    def start(self) -> None:
        """Write the record under a new lease (raises if etcd does not answer), then keep it alive."""
        self._write_new_lease()
        self._thread = threading.Thread(target=self._run, name="trainwarden-membership", daemon=True)
        self._thread.start()

    def update(self, **fields: Any) -> None:
        """Change fields of the record; written by the keep-alive thread, never here."""
        with self._cond:
            self._record.update(fields)
            self._dirty = True
            self._cond.notify()

    @property
    def lost_since(self) -> float | None:
        """Monotonic time since which etcd has not confirmed the record for longer than its TTL; None while
        the membership is confirmed."""
        confirmed = self.confirmed_at
        if confirmed is None or self._clock() - confirmed <= self._ttl:
            return None
        return confirmed + self._ttl

    def unconfirmed_for(self) -> float:
        """Seconds since etcd last confirmed the record (it is confirmed every TTL/3 while etcd answers)."""
        confirmed = self.confirmed_at
        return 0.0 if confirmed is None else max(0.0, self._clock() - confirmed)

    @property
    def ttl(self) -> float:
        return float(self._ttl)

    @property
    def period(self) -> float:
        """Seconds between confirmations while etcd answers."""
        return max(0.5, self._ttl / 3)

    def stop(self, timeout: float = 3.0) -> None:
        """Stop the keep-alive, say the node departed on purpose, and revoke the lease: the record goes at
        once (best effort)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        lease = self._lease
        if lease is not None:
            try:
                mark_departed(self._client, self.job, self.node, prefix=self._prefix)
                lease.revoke()
            except Exception as exc:
                logger.info("cannot revoke the lease of %s (%s); it expires in %d s", self.key,
                            describe_etcd_error(exc), self._ttl)

    # ---- the keep-alive thread -------------------------------------------------------------------------

    def _write_new_lease(self) -> None:
        lease = with_failover(self._client, lambda: self._client.lease(self._ttl))
        with self._cond:
            value, self._dirty = json.dumps(self._record, sort_keys=True), False
        with_failover(self._client, lambda: self._client.put(self.key, value, lease=lease))
        self._lease = lease
        self.confirmed_at = self._clock()

    def _run(self) -> None:
        period = self.period
        down_since: float | None = None
        while True:
            with self._cond:
                if not self._dirty and not self._stopping:
                    self._cond.wait(period)
                if self._stopping:
                    return
                dirty = self._dirty
            try:
                if self._refresh():
                    if dirty:
                        with self._cond:
                            value, self._dirty = json.dumps(self._record, sort_keys=True), False
                        lease = self._lease
                        with_failover(self._client, lambda: self._client.put(self.key, value, lease=lease))
                else:  # the lease expired while etcd was away: the node is still here, say so again
                    logger.warning("the etcd lease of %s expired; writing the record again under a new one", self.key)
                    self._write_new_lease()
                self.confirmed_at = self._clock()
                if down_since is not None:
                    logger.warning("etcd confirms %s again after %.1f s", self.key, self._clock() - down_since)
                    down_since = None
            except Exception as exc:
                if down_since is None:
                    down_since = self._clock()
                    logger.warning("cannot keep %s alive in etcd (%s); retrying", self.key, describe_etcd_error(exc))
                with self._cond:
                    if not self._stopping:
                        self._cond.wait(1.0)

    def _refresh(self) -> bool:
        """Refresh the lease; False if etcd says it has expired."""
        return refresh_lease(self._client, self._lease)

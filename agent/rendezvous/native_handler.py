"""torchrun's ``RendezvousHandler`` on the etcd-native round: ``--rdzv-backend etcd3 --rdzv-conf round=native``.

`trainwarden run` passes ``round=native`` unless told ``--rendezvous-round dynamic``; for plain torchrun the ``etcd3``
backend's default stays torch's dynamic rendezvous. With it, each torchrun agent is one node of
``native.NativeRendezvous``:

* its node id is ``<local address or FQDN>_<pid>_<n>`` (torch's own node descriptor: ``n`` counts the handlers
  of the process), and ranks follow the sorted ids;
* its lease is granted here with a TTL of ``keep_alive_interval × keep_alive_max_attempt`` (torch's rule for
  a dead node: 5 s × 3 by default) and refreshed on a thread of its own every third of it; a lease that etcd
  let expire (etcd away or the node starved longer than the TTL) is replaced there at once, and a node waiting in
  a round joins it again with the new one (``NativeRendezvous.lease_renewed``: before, a round that needed it
  waited until the join timeout, issue 45);
* ``next_rendezvous`` waits out an etcd that does not answer (quorum lost while a worker died: a restart needs a
  round) for up to ``join_timeout``, trying every ``ETCD_RETRY_S``; torch's agent would end the job on the error;
* ``next_rendezvous`` is ``next_round`` plus torch's bootstrap: the round's c10d store is ``Etcd3Store`` under
  ``rdzv/<run_id>/store/native/<round>/``, and the agent of rank 0 starts the workers' TCPStore server for the
  round itself and publishes its port there (``RendezvousStoreInfo``; ``use_agent_store`` is True, so every
  worker connects as a client). A new server every round, so no worker ever finds a dead round's keys (what
  torch's dynamic handler risks with its one shared store, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``); the server
  of the round before is stopped when the next one starts. Not worker rank 0's server, as torch's bootstrap
  has it otherwise: the other workers that dialled before rank 0 listened backed off, and the process group
  came up 0.1-0.7 s late in about half the starts and restarts (BENCHMARKS.md, issue 26). The server listens on
  the node's ``local_addr`` only (loopback in a one-node `trainwarden run`): agent/rendezvous/workers_store.py.
  Rank 0's agent also deletes the earlier rounds' bootstrap keys (one round's in etcd, not one per restart);
* ``num_nodes_waiting`` counts the nodes waiting in the next round (none while this round has ``max_nodes``: a
  full round cannot admit them, so they wait as hot spares instead of restarting the job over and over), plus
  one once a member of this round is
  gone (its key went with its lease): torchrun's agent then restarts its workers into the next round at once,
  instead of when a collective fails. torchrun asks every monitor interval (4 times a second under
  `trainwarden run`); the loss comes from the round's watch, the waiting nodes are counted at most every
  ``WAITING_POLL_S`` and the round's keys (``present``: the net under a watch that python3-etcd3 dropped without a
  word) every ``RECOUNT_S`` and at once when the watch is gone (issue 28: two count reads per node per tick were
  32,000 reads a second at 4,000 nodes, half of them over all the round's keys). A watch broken by an etcd outage
  is not a loss: it is made again once etcd answers, from the round's close, so a loss during the outage is seen;
* ``set_closed``/``is_closed``: ``rdzv/<run_id>/closed``; ``shutdown`` leaves, closes (as the dynamic
  handler does when the job is over) and revokes the lease. A node waiting for a round (a spare) asks every
  ``resync_s`` whether the rendezvous was closed and then ends without error (``RendezvousGracefulExitError``).
  The closed key says who closed it and how that node's workers ended (``job_outcome``, which the launcher sets
  before torch's agent shuts the handler down): a node that restarts its workers after another node's finished
  the job (they ended ``SUCCEEDED``) ends without error too, not with ``RendezvousClosedError`` (issue 45: a node
  whose worker took 30 s to stop missed the job's last steps and its `trainwarden run` failed a finished job).

``join_timeout`` (default 600 s) and ``last_call_timeout`` (default 30 s, torch's) come from rdzv-conf as for
the dynamic handler.
"""

from __future__ import annotations

import logging
import os
import socket
import itertools
import json
import threading
import time
from typing import Callable

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from trainwarden.agent.etcd.client import (ETCD_CLIENT_ERRORS, describe_etcd_error, is_auth_error, refresh_lease,
                                          with_failover)
from trainwarden.agent.etcd.keys import rdzv_key
from trainwarden.agent.rendezvous import workers_store
from trainwarden.agent.rendezvous.native import (NativeRendezvous, NativeRendezvousClosed, NativeRendezvousConfig,
                                                 NativeRendezvousError, NativeRendezvousTimeout,
                                                 NativeRendezvousUnavailable, Round, RoundWatch)

logger = logging.getLogger(__name__)

WAITING_POLL_S = 5.0
"""How often ``num_nodes_waiting`` counts the nodes waiting to join the next round (a job growing): torch's agent
then restarts the workers to admit them, which the grow protocol holds for a checkpoint anyway (up to GROW_WAIT_S);
a few seconds more cost nothing, where a read each tick was 16,000 reads a second at 4,000 nodes."""
RECOUNT_S = 30.0
"""How often it counts the round's keys although the round's watch lives: the net under a watch lost unseen (one
count-only read over the round's N keys per node, so N²/RECOUNT_S key visits a second for the job)."""

ETCD_RETRY_S = 1.0
"""How often a restart that found etcd silent tries the round again (the client skips a failed member for
``FAILOVER_RETRY_S``, so a member back is used within about two tries)."""
ETCD_AWAY_LOG_S = 30.0
"""How often that wait says so in the log."""

__all__ = ["NativeRendezvousHandler", "spare_swap"]

_handlers_in_process = itertools.count()


def spare_swap(before: Round | None, after: Round) -> bool:
    """Whether a node that was not in round ``before`` holds one of its positions in ``after``: newcomers take a
    lost member's position, and go after the members when the job grows (native.py, **Ranks**)."""
    if before is None:
        return False
    return any(node not in before.members for node in after.members[: before.world_size])


def _etcd_away(exc: RendezvousConnectionError) -> bool:
    """Whether ``exc`` says etcd did not answer (retryable), rather than refused this node (its credentials,
    its lease) or failed in the rendezvous itself."""
    cause = exc.__cause__
    if isinstance(cause, NativeRendezvousUnavailable):
        return True
    return isinstance(cause, ETCD_CLIENT_ERRORS) and not is_auth_error(cause)


class NativeRendezvousHandler(RendezvousHandler):
    """One torchrun agent's side of the native rendezvous (see the module docstring)."""

    def __init__(self, client, store, params: RendezvousParameters, *, key_prefix: str) -> None:
        self._client, self._store, self._run_id = client, store, params.run_id
        self._local_addr = params.local_addr
        addr = (params.local_addr or socket.getfqdn()).replace("/", "_")
        self.node = f"{addr}_{os.getpid()}_{next(_handlers_in_process)}"
        self._closed_key = rdzv_key(params.run_id, "closed", prefix=key_prefix)
        self._ttl = params.get_as_int("keep_alive_interval", 5) * params.get_as_int("keep_alive_max_attempt", 3)
        self._config = NativeRendezvousConfig(
            min_nodes=params.min_nodes, max_nodes=params.max_nodes,
            last_call_s=float(params.get_as_int("last_call_timeout", 30)),
            join_timeout_s=float(params.get_as_int("join_timeout", 600)))
        self._key_prefix = key_prefix
        self._lease = self._grant()
        self._rdzv = self._native(self._lease)
        self._watch: RoundWatch | None = None
        self.round_number: int | None = None
        """The round this node's workers belong to (the same on every node): fencing, leaves and growth key on it."""
        self.job_outcome: str | None = None
        """How this node's workers ended (``WorkerState`` name), set by the launcher before torch's agent calls
        ``shutdown``: written into the closed key for the nodes that restart after it."""
        self.spare_swap = False
        """Whether, in that round, a node new to it took the place of a member of this node's round before (a hot
        spare replaced a lost node): the goodput ledger charges the round's recovery to ``spare_swap``."""
        self._waiting, self._waiting_at = 0, None  # the next round's joins, counted at most every WAITING_POLL_S
        self._short, self._counted_at = False, None  # the round's keys fewer than its members, as last counted
        self._workers_store: TCPStore | None = None  # on rank 0's node: the round's server for the workers
        self.on_wait: Callable[[int], None] | None = None
        """Told the round this node waits in when a round closed without it (a hot spare): set by the launcher's
        agent (agent/launch/elastic.py), which reports it to ``trainwarden run``."""
        self._stop = threading.Event()
        self._keeper = threading.Thread(target=self._keep_alive, name="trainwarden-rdzv-lease", daemon=True)
        self._keeper.start()

    # -- torch's RendezvousHandler ----------------------------------------------------------------------

    def get_backend(self) -> str:
        return "etcd3"

    @property
    def use_agent_store(self) -> bool:
        """True: the workers' TCPStore is the one this agent (on rank 0's node) hosts for the round."""
        return True

    def get_run_id(self) -> str:
        return self._run_id

    def next_rendezvous(self) -> RendezvousInfo:
        """The next round, waiting out an etcd that does not answer (a member down, quorum lost) for up to
        ``join_timeout``: torchrun's agent ends the job on ``RendezvousConnectionError``, and a restart that
        happened to fall into an outage of a few seconds is no reason to (issue 45: the soak's loss of quorum met
        a restart and the run ended). Every other error is raised at once."""
        deadline = time.monotonic() + self._config.join_timeout_s
        away_since, told = None, None
        while True:
            try:
                info = self._next_rendezvous_once()
            except RendezvousConnectionError as exc:
                now = time.monotonic()
                if not _etcd_away(exc) or now >= deadline:
                    raise
                if away_since is None:
                    away_since = now
                if told is None or now - told >= ETCD_AWAY_LOG_S:
                    told = now
                    logger.warning("node %s: the restart waits for etcd, which does not answer (%s); it tries "
                                   "again every %g s for %.0f s more", self.node, exc, ETCD_RETRY_S,
                                   deadline - now)
                time.sleep(min(ETCD_RETRY_S, max(0.0, deadline - now)))
                continue
            if away_since is not None:
                logger.warning("node %s: etcd answered again after %.1f s; the round is joined", self.node,
                               time.monotonic() - away_since)
            return info

    def _next_rendezvous_once(self) -> RendezvousInfo:
        closed = self.closed_by()
        if closed is not None:
            node, outcome = closed
            if outcome == "SUCCEEDED":
                raise RendezvousGracefulExitError(
                    f"job {self._run_id!r} finished: node {node}'s workers succeeded while this node restarted its "
                    f"own; nothing is left to train")
            ended = f" ({node}'s workers ended {outcome})" if outcome else ""
            raise RendezvousClosedError(f"the rendezvous of {self._run_id!r} is closed (the job ended{ended}); use "
                                        f"a new --rdzv-id, or delete its keys to run it again")
        if not self._lease_alive():
            if self._watch is not None:
                self._watch.cancel()
            last, self._lease = self._rdzv.last, self._grant()
            self._rdzv = self._native(self._lease)
            self._rdzv.last = last
        before = self._rdzv.last
        try:
            round_ = self._rdzv.next_round()
            self.round_number = round_.number
            self.spare_swap = spare_swap(before, round_)
            self._watch = self._rdzv.watch()
            self._waiting, self._waiting_at, self._short, self._counted_at = 0, None, False, None
        except NativeRendezvousTimeout as exc:
            raise RendezvousTimeoutError(str(exc)) from exc
        except NativeRendezvousClosed as exc:  # the job ended while this node waited (a spare never needed)
            raise RendezvousGracefulExitError(str(exc)) from exc
        except NativeRendezvousError as exc:  # etcd away (retried by next_rendezvous) or this node's lease gone
            raise RendezvousConnectionError(str(exc)) from exc
        logger.info("node %s joined round %d of %r as rank %d of %d", self.node, round_.number, self._run_id,
                    round_.rank, round_.world_size)
        store = PrefixStore(f"native/{round_.number}", self._store)
        if round_.rank == 0:
            self._forget_rounds_before(round_.number)
        self._stop_workers_store()
        if round_.rank == 0 and self._local_addr:  # on the job's address only: agent/rendezvous/workers_store.py
            self._workers_store = workers_store.serve(self._local_addr)
        elif round_.rank == 0:  # plain torchrun without --local-addr: torch's default, every interface
            self._workers_store = TCPStore(socket.getfqdn(), 0, is_master=True, wait_for_workers=False)
        port = self._workers_store.port if self._workers_store is not None else None
        info = RendezvousStoreInfo.build(round_.rank, store, local_addr=self._local_addr, server_port=port)
        return RendezvousInfo(store, round_.rank, round_.world_size, info)

    def _forget_rounds_before(self, number: int) -> None:
        """Rank 0 of round ``number`` deletes the bootstrap keys of the job's earlier rounds (their workers are gone:
        every node stopped its own before it joined this round), so a job of many restarts does not leave a round's
        keys in etcd for each (the soak's hour: every round's were still there at its end). Best effort: keys left by
        an etcd that did not answer go with the next round."""
        prefix = rdzv_key(self._run_id, "store", "native", prefix=self._key_prefix) + "/"
        try:
            rounds = {meta.key.decode()[len(prefix):].split("/", 1)[0]
                      for _, meta in self._client.get_prefix(prefix, keys_only=True)}
            for old in sorted(r for r in rounds if r.isdigit() and int(r) < number):
                self._client.delete_prefix(f"{prefix}{old}/")
        except ETCD_CLIENT_ERRORS as exc:
            logger.debug("could not delete the bootstrap keys of rounds before %d: %s", number, exc)

    def _stop_workers_store(self) -> None:
        """Stop the workers' TCPStore server of the round before (its workers are gone: torch's agent asks
        for a new round only after it stopped them)."""
        self._workers_store = None  # the server stops with its last reference

    def is_closed(self) -> bool:
        return self.closed_by() is not None

    def closed_by(self) -> tuple[str, str | None] | None:
        """(the node that closed the rendezvous, how its workers ended or None when it did not say); None while
        open."""
        value, _ = self._etcd("read whether the rendezvous is closed", lambda: self._client.get(self._closed_key))
        if value is None:
            return None
        text = value.decode(errors="replace")
        try:
            record = json.loads(text)
        except ValueError:
            return text, None  # closed by a handler that wrote its node id only
        if not isinstance(record, dict):
            return text, None
        outcome = record.get("outcome")
        return str(record.get("node", "")), outcome if isinstance(outcome, str) else None

    def set_closed(self) -> None:
        record = json.dumps({"node": self.node, "outcome": self.job_outcome})
        self._etcd("close the rendezvous", lambda: self._client.put(self._closed_key, record))

    def num_nodes_waiting(self) -> int:
        if self._rdzv.last is None:
            return 0
        now = time.monotonic()
        try:
            recount = False
            watch = self._watch
            if watch is None or (watch.lost is None and (watch.error is not None or not watch.alive())):
                # the watch broke (etcd away) or was dropped unseen: watch again from the round's close, which
                # replays a loss since, and count the round's keys now
                if watch is not None:
                    watch.cancel()
                self._watch = self._rdzv.watch()
                recount = True
            if self._rdzv.last.world_size >= self._config.max_nodes:
                self._waiting = 0  # a full round admits nobody: the nodes after it wait as spares
            elif self._waiting_at is None or now - self._waiting_at >= WAITING_POLL_S:
                self._waiting, self._waiting_at = self._rdzv.waiting(), now
            # a lost member counts, a broken watch does not (an etcd outage must not restart training)
            lost = self._watch.lost is not None or self._short
            if not lost and (recount or self._counted_at is None or now - self._counted_at >= RECOUNT_S):
                self._short = self._rdzv.present() < self._rdzv.last.world_size
                self._counted_at, lost = now, self._short
        except NativeRendezvousError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        except ETCD_CLIENT_ERRORS as exc:  # torchrun's agent ends on any other error: etcd away is no loss
            raise RendezvousConnectionError(describe_etcd_error(exc)) from exc
        return self._waiting + (1 if lost else 0)

    def shutdown(self) -> bool:
        self._stop.set()
        self._stop_workers_store()
        try:
            if self._watch is not None:
                self._watch.cancel()
            self.set_closed()
            try:
                self._rdzv.leave()
            except NativeRendezvousError as exc:
                raise RendezvousConnectionError(str(exc)) from exc
            self._etcd("revoke the node's lease", lambda: self._client.revoke_lease(self._lease.id))
            return True
        except RendezvousConnectionError as exc:
            logger.warning("the native rendezvous of %r did not shut down cleanly: %s", self._run_id, exc)
            return False

    # -- the lease --------------------------------------------------------------------------------------

    def _native(self, lease) -> NativeRendezvous:
        return NativeRendezvous(self._client, job=self._run_id, node=self.node, lease=lease, config=self._config,
                                prefix=self._key_prefix, closed=self._closed_quietly, on_wait=self._waiting_in)

    def _waiting_in(self, round_: int) -> None:
        if self.on_wait is not None:
            self.on_wait(round_)

    def _closed_quietly(self) -> bool:
        """``is_closed`` for a node waiting for a round: etcd away is not a closed rendezvous."""
        try:
            return self.is_closed()
        except RendezvousConnectionError:
            return False

    def _grant(self):
        return self._etcd("grant the node's lease", lambda: self._client.lease(self._ttl))

    def _lease_alive(self) -> bool:
        try:
            return refresh_lease(self._client, self._lease)
        except ETCD_CLIENT_ERRORS:
            return False

    def _keep_alive(self) -> None:
        while not self._stop.wait(max(0.5, self._ttl / 3)):
            try:
                if not refresh_lease(self._client, self._lease):
                    # granted here, at once: a node waiting in a round joins it again with the new lease
                    # (NativeRendezvous.lease_renewed); a member's lost key has ended its round regardless
                    self._lease = self._client.lease(self._ttl)
                    self._rdzv.lease_renewed(self._lease)
                    logger.warning("node %s: its rendezvous lease expired; granted a new one", self.node)
            except Exception as exc:  # noqa: BLE001 - the loop outlives one bad refresh (etcd away)
                logger.warning("node %s: could not refresh its rendezvous lease: %s", self.node,
                               describe_etcd_error(exc))

    def _etcd(self, what: str, op):
        try:
            return with_failover(self._client, op)
        except ETCD_CLIENT_ERRORS as exc:
            raise RendezvousConnectionError(f"could not {what} of {self._run_id!r} in etcd "
                                            f"({describe_etcd_error(exc)}); check that etcd is running") from exc


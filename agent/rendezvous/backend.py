"""The ``etcd3`` torchrun rendezvous backend: torch's dynamic rendezvous, kept in etcd over the v3 API.

``torchrun --rdzv-backend etcd3 --rdzv-endpoint HOST:PORT --rdzv-id JOB`` finds this module through the
``torchrun.handlers`` entry point (``trainwarden.agent.rendezvous:handler_factory``). torch's own ``etcd``/``etcd-v2`` backends speak the
v2 API, which etcd 3.5 disables by default and 3.6 removed; ``c10d`` keeps the state in a TCPStore that
dies with its host. This backend keeps it in etcd, which survives any node.

What it is made of:

* ``Etcd3RendezvousBackend`` implements torch's ``RendezvousBackend``: the pickled rendezvous state at
  ``<key_prefix>/rdzv/<run_id>/state`` (DESIGN.md's ``jobs/<job>/rdzv``, moved out of ``jobs/`` so that only
  agents' etcd role may write it: agent/etcd/keys.py; ``key_prefix`` defaults to ``/trainwarden/v1``), with the key's ``mod_revision`` as the fencing token. ``set_state`` is one etcd
  transaction: compare the revision (or "key absent" for token ``None``), put and read back on success,
  read the current value on failure, so every answer is a consistent snapshot. The state is wrapped in
  a small envelope (magic, version, CRC-32) so a value that was not written by this backend, or was
  truncated, is reported as ``RendezvousStateError`` instead of being unpickled.
* ``Etcd3Store`` (``etcd_store.py``) is the c10d store the handler uses for round data and agent barriers.
* ``torch.distributed.elastic.rendezvous.dynamic_rendezvous.create_handler`` does the rest: joining,
  heartbeats, last call, closing. Nothing of its logic is copied here. One rule is added
  (``members.py``): a restart's round closes as soon as the previous round's living members are back,
  instead of waiting out the last call.

The client (``connect``) is ``python3-etcd3`` with two deliberate differences from ``etcd3.client()``:
a 2 s connect probe (``grpc.channel_ready_future``) so a wrong endpoint fails at start-up with
``RendezvousConnectionError`` instead of on the first read after ``read_timeout``; and an endpoint that is
never blacklisted after an error (``time_retry=0``) and reconnects within a second: the stock client
refuses to use a single endpoint for 300 s after one failed call, and gRPC's reconnect back-off grows to
two minutes; either would turn a short etcd restart into minutes of errors.

Restarts. With torch >= 2.4 the dynamic handler shares one agent-hosted TCPStore with the workers across
all restart rounds (``use_agent_store``). Workers of a restarted round then find the previous round's
keys in that store, and gloo's ``connectFullMesh`` dials the dead workers' ports ("Connection refused");
NCCL's unique-id exchange goes through the same store and has the same hazard. The only switch torch
offers is the environment variable ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``, which
``DynamicRendezvousHandler.next_rendezvous`` reads directly (and ``use_agent_store`` reports to the agent,
which tells the workers). So the creator sets it to ``1`` in torchrun's own process before it creates the
handler: every round, rank 0 then picks a fresh free port for the workers' TCPStore and publishes it through
``Etcd3Store``. Setting it once, up front, keeps the handler and the agent consistent; a subclass could
only override ``use_agent_store`` and would disagree with ``next_rendezvous``. The cost (one TCPStore per
round instead of one per job) is negligible.

rdzv-conf options: ``key_prefix``, ``read_timeout`` (s, default 60), ``protocol`` (http|https; https when
a certificate is given), ``ca_cert``, ``cert_key`` (alias ``ssl_cert_key``), ``cert_cert`` (alias
``ssl_cert``), ``user``, ``password_file`` (or ``$TRAINWARDEN_ETCD_PASSWORD_FILE``: the password is read
from the file; an inline ``password`` is refused, since torchrun logs its options and ``ps`` shows them),
``round`` (``dynamic``, torch's rendezvous, the default; ``native``, the etcd-native round of
``native_handler.py``, a key per node and one closing transaction, for jobs of hundreds of nodes),
and the dynamic rendezvous' own ``join_timeout``,
``last_call_timeout``, ``close_timeout``, ``heartbeat_timeout``, ``keep_alive_interval``,
``keep_alive_max_attempt``. torchrun adds ``timeout`` itself (unused by the dynamic handler, as with c10d).
Anything else is rejected with ``ValueError``.

A run id is single-use: after the job ends its rendezvous is closed, and a new torchrun with the same id
gets ``RendezvousClosedError``. Use a new id, or (what ``trainwarden run`` does when a finished job runs again)
delete ``<key_prefix>/rdzv/<run_id>/``.
"""

from __future__ import annotations

import logging
import time
import os
import zlib
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

import etcd3
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
    create_handler,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from trainwarden.agent.etcd.client import (ETCD_CLIENT_ERRORS, SECURITY_ENV, EtcdAccessDenied, EtcdConfig,
                                          EtcdUnavailable, describe_etcd_error, open_etcd, read_password_file,
                                          with_failover)
from trainwarden.agent.shared.contract import validate_job_name
from trainwarden.agent.rendezvous.members import close_when_members_rejoin
from trainwarden.agent.rendezvous.store import Etcd3Store
from trainwarden.agent.etcd.keys import DEFAULT_PREFIX, rdzv_key

logger = logging.getLogger(__name__)

__all__ = [
    "BACKEND_NAME",
    "DEFAULT_KEY_PREFIX",
    "Etcd3RendezvousBackend",
    "Etcd3RendezvousConfig",
    "connect",
    "create_rdzv_handler",
]

BACKEND_NAME = "etcd3"
DEFAULT_KEY_PREFIX = DEFAULT_PREFIX
DEFAULT_PORT = 2379
SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
PASSWORD_FILE_ENV = SECURITY_ENV["password_file"]

_ALIASES = {"ssl_cert_key": "cert_key", "ssl_cert": "cert_cert"}
_ETCD_KEYS = frozenset(
    {"key_prefix", "read_timeout", "protocol", "ca_cert", "cert_key", "cert_cert", "user", "password_file"}
)
_HANDLER_INT_KEYS = frozenset({
    "join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
    "keep_alive_interval", "keep_alive_max_attempt",
})
_ROUND_KEY = "round"  # "dynamic" (torch's, the default) or "native" (native_handler.py)
_TORCHRUN_KEYS = frozenset({"timeout"})  # added by torchrun itself; the dynamic handler ignores it
_KNOWN_KEYS = _ETCD_KEYS | _HANDLER_INT_KEYS | _TORCHRUN_KEYS | frozenset(_ALIASES) | {_ROUND_KEY}

# gRPC's default reconnect back-off grows to 120 s: after an etcd restart the channel could stay down
# for minutes. Cap it at 1 s so the client is back within a second of etcd.
_MAGIC = b"trainwarden-rdzv/1 "  # envelope: MAGIC + crc32 as 8 hex digits + b"\n" + pickled state
_HEADER_LEN = len(_MAGIC) + 9


@dataclass(frozen=True, kw_only=True)
class Etcd3RendezvousConfig:
    """How to reach etcd and where to keep a job's rendezvous in it."""

    host: str
    """etcd host name or address (from ``--rdzv-endpoint``)."""
    port: int = DEFAULT_PORT
    """etcd client port."""
    other_members: tuple[str, ...] = ()
    """``host:port`` of the cluster's other members (``--rdzv-endpoint a:2379,b:2379,c:2379``)."""
    key_prefix: str = DEFAULT_KEY_PREFIX
    """Root of trainwarden's keys; the job's rendezvous keys go under ``<key_prefix>/rdzv/<run_id>/``."""
    read_timeout: float = 60.0
    """Deadline of each etcd request, in seconds."""
    connect_timeout: float = 2.0
    """How long the start-up probe waits for a connection before failing."""
    protocol: str = "http"
    """``http`` (plain gRPC) or ``https`` (TLS)."""
    ca_cert: str | None = None
    """CA bundle for TLS; the system roots when ``None``."""
    cert_key: str | None = None
    """Client private key for mutual TLS (with ``cert_cert``)."""
    cert_cert: str | None = None
    """Client certificate for mutual TLS (with ``cert_key``)."""
    user: str | None = None
    """etcd user for authentication (with ``password``)."""
    password: str | None = field(default=None, repr=False)
    """etcd password for ``user`` (read from ``password_file`` by ``from_params``)."""

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("the etcd3 rendezvous needs --rdzv-endpoint HOST[:PORT]")
        if not 0 < self.port < 65536:
            raise ValueError(f"etcd port {self.port} is not a TCP port (1-65535)")
        if not self.key_prefix.startswith("/") or self.key_prefix.endswith("/"):
            raise ValueError(
                f"rdzv-conf key_prefix={self.key_prefix!r} must start with '/' and not end with one, "
                f"e.g. {DEFAULT_KEY_PREFIX}"
            )
        for name in ("read_timeout", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"rdzv-conf {name}={getattr(self, name)!r} must be a positive number of seconds")
        if self.protocol not in ("http", "https"):
            raise ValueError(f"rdzv-conf protocol={self.protocol!r} must be http or https")
        tls_files = {n: getattr(self, n) for n in ("ca_cert", "cert_key", "cert_cert") if getattr(self, n)}
        if self.protocol == "http" and tls_files:
            raise ValueError(
                f"rdzv-conf {', '.join(tls_files)} given with protocol=http; set protocol=https or drop them"
            )
        try:  # the TLS and auth rules are the etcd client's own; say which flags they came from
            etcd = EtcdConfig(endpoints=tuple(f"{self.protocol}://{n}" for n in (self.netloc, *self.other_members)),
                              ca_cert=self.ca_cert,
                              cert_key=self.cert_key, cert_cert=self.cert_cert, user=self.user,
                              password=self.password, timeout=self.read_timeout,
                              connect_timeout=self.connect_timeout)
        except ValueError as exc:
            raise ValueError(f"rdzv-conf {exc}") from None
        object.__setattr__(self, "_etcd", etcd)

    @property
    def etcd(self) -> EtcdConfig:
        """The etcd client settings these options make."""
        return self._etcd  # type: ignore[attr-defined]

    @property
    def netloc(self) -> str:
        """``host:port`` as gRPC dials it (IPv6 addresses in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @classmethod
    def from_params(
        cls, params: RendezvousParameters, environ: Mapping[str, str] = os.environ
    ) -> "Etcd3RendezvousConfig":
        """Build from torchrun's parameters (``--rdzv-endpoint``, ``--rdzv-conf``); ``ValueError`` if invalid.

        The password comes from a file: rdzv-conf ``password_file=PATH``, else ``$TRAINWARDEN_ETCD_PASSWORD_FILE``.
        Never from rdzv-conf itself: torchrun prints its options in its launch log, and ``ps`` shows them.
        """
        conf = _canonical_conf(params.config)
        given_file = conf.pop("password_file", None)
        password_file = given_file or environ.get(PASSWORD_FILE_ENV)
        if conf.get("user"):
            if not password_file:
                raise ValueError(f"rdzv-conf user={conf['user']!r} needs password_file=PATH (or "
                                 f"${PASSWORD_FILE_ENV}): the file holding the user's etcd password")
            try:
                conf["password"] = read_password_file(str(password_file))
            except ValueError as exc:
                raise ValueError(f"rdzv-conf {exc}") from None
        elif given_file:
            raise ValueError("rdzv-conf password_file given without user; give both")
        # several members: HOST:PORT,HOST:PORT,... (any one that answers serves; the loss of one is survived)
        members, scheme = [], None
        for part in (params.endpoint or "").split(","):
            endpoint = part.strip()
            for prefix in ("http://", "https://"):
                if endpoint.startswith(prefix):
                    scheme, endpoint = prefix[:-3], endpoint[len(prefix):].rstrip("/")
            if endpoint:
                members.append(parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_PORT))
        if not members:
            raise ValueError("the etcd3 rendezvous needs --rdzv-endpoint HOST[:PORT][,HOST:PORT...] (etcd's client URLs)")
        (host, port), others = members[0], members[1:]
        tls_given = any(conf.get(k) for k in ("ca_cert", "cert_key", "cert_cert"))
        protocol = str(conf.get("protocol", scheme or ("https" if tls_given else "http"))).strip().lower()
        kwargs: dict[str, Any] = {"host": host, "port": port, "protocol": protocol,
                                  "other_members": tuple(_netloc(h, p) for h, p in others)}
        if "key_prefix" in conf:
            kwargs["key_prefix"] = str(conf["key_prefix"]).strip()
        if "read_timeout" in conf:
            kwargs["read_timeout"] = _as_float("read_timeout", conf["read_timeout"])
        for name in ("ca_cert", "cert_key", "cert_cert", "user", "password"):
            if conf.get(name):
                kwargs[name] = str(conf[name])
        return cls(**kwargs)


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _canonical_conf(config: dict[str, Any]) -> dict[str, Any]:
    """Reject unknown keys, fold aliases, and check the dynamic handler's integer options."""
    if "password" in config:
        raise ValueError("rdzv-conf password=... would put the etcd password on torchrun's command line (ps shows "
                         "it; torchrun logs it): write it to a file only the job's user can read and pass "
                         "password_file=PATH")
    unknown = sorted(set(config) - _KNOWN_KEYS)
    if unknown:
        raise ValueError(
            f"unknown rdzv-conf option(s) for the etcd3 rendezvous: {', '.join(unknown)}; "
            f"known: {', '.join(sorted(_KNOWN_KEYS))}"
        )
    conf = {k: v for k, v in config.items() if k not in _ALIASES}
    for alias, name in _ALIASES.items():
        if alias in config:
            if name in conf and str(conf[name]) != str(config[alias]):
                raise ValueError(f"rdzv-conf {alias} and {name} name the same option with different values; give one")
            conf[name] = config[alias]
    for name in _HANDLER_INT_KEYS & set(conf):
        try:
            value = int(str(conf[name]).strip())
        except ValueError:
            value = 0
        if value <= 0:
            raise ValueError(f"rdzv-conf {name}={conf[name]!r} must be a positive integer (seconds or count)")
    return conf


def _as_float(name: str, value: Any) -> float:
    try:
        return float(str(value).strip())
    except ValueError:
        raise ValueError(f"rdzv-conf {name}={value!r} must be a number of seconds") from None


def connect(config: Etcd3RendezvousConfig) -> etcd3.MultiEndpointEtcd3Client:
    """A client for ``config``'s etcd, after checking within ``connect_timeout`` that it answers.

    Raises ``RendezvousConnectionError`` when etcd cannot be reached or refuses the credentials.
    """
    try:
        return open_etcd(config.etcd)
    except EtcdUnavailable:
        raise RendezvousConnectionError(
            f"cannot reach etcd at {config.etcd.describe()}: no {config.protocol} connection within "
            f"{config.connect_timeout:.1f}s; start etcd or pass the right --rdzv-endpoint"
        ) from None
    except EtcdAccessDenied as exc:
        raise RendezvousConnectionError(f"{exc}; check rdzv-conf user and password_file") from exc


class Etcd3RendezvousBackend(RendezvousBackend):
    """torch's ``RendezvousBackend`` on etcd v3: the state at ``<key_prefix>/rdzv/<run_id>/state``.

    The fencing token is the key's ``mod_revision`` (an ``int``). See the module docstring.
    """

    def __init__(
        self,
        client: etcd3.MultiEndpointEtcd3Client,
        run_id: str,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        endpoint: str = "etcd",
    ) -> None:
        _check_run_id(run_id)
        self._client = client
        self._endpoint = endpoint
        self.key = rdzv_key(run_id, "state", prefix=key_prefix)

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Token] | None:
        try:
            value, meta = with_failover(self._client, lambda: self._client.get(self.key))
        except ETCD_CLIENT_ERRORS as exc:
            raise self._connection_error("read", exc) from exc
        if value is None:
            return None
        return self._decode(value), meta.mod_revision

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        tx = self._client.transactions
        if token is None:
            guard = tx.version(self.key) == 0  # create only
        else:
            revision = _parse_token(token)
            if revision is None:  # not a token this backend handed out: nothing can match it
                current = self.get_state()
                return None if current is None else (*current, False)
            guard = tx.mod(self.key) == revision
        try:
            ok, responses = with_failover(self._client, lambda: self._client.transaction(
                compare=[guard],
                success=[tx.put(self.key, _encode(state)), tx.get(self.key)],
                failure=[tx.get(self.key)],
            ))
        except ETCD_CLIENT_ERRORS as exc:
            raise self._connection_error("write", exc) from exc
        kvs = responses[-1]
        if not kvs:  # stale token and the key is gone: like v2, report "no state"
            return None
        value, meta = kvs[0]
        return self._decode(value), meta.mod_revision, bool(ok)

    def _decode(self, value: bytes) -> bytes:
        try:
            return _decode(value)
        except ValueError as exc:
            raise RendezvousStateError(
                f"the rendezvous state at {self.key} in etcd {self._endpoint} is corrupt ({exc}); "
                f"delete the key (etcdctl del {self.key}) or use a new --rdzv-id"
            ) from None

    def _connection_error(self, what: str, exc: BaseException) -> RendezvousConnectionError:
        return RendezvousConnectionError(
            f"cannot {what} the rendezvous state {self.key} at etcd {self._endpoint}: "
            f"{describe_etcd_error(exc)}; check that etcd is running and reachable from this node"
        )


def _encode(state: bytes) -> bytes:
    return _MAGIC + b"%08x\n" % zlib.crc32(state) + state


def _decode(value: bytes) -> bytes:
    if not value.startswith(_MAGIC) or len(value) < _HEADER_LEN or value[_HEADER_LEN - 1 : _HEADER_LEN] != b"\n":
        raise ValueError("not written by the trainwarden etcd3 rendezvous backend, version 1")
    try:
        crc = int(value[len(_MAGIC) : _HEADER_LEN - 1], 16)
    except ValueError:
        raise ValueError("unreadable checksum") from None
    state = value[_HEADER_LEN:]
    if zlib.crc32(state) != crc:
        raise ValueError("checksum mismatch: the value was truncated or altered")
    return state


def _parse_token(token: Token) -> int | None:
    """The revision in ``token``, or ``None`` if it is not one (wrong type, not an integer, not positive)."""
    if isinstance(token, bool) or not isinstance(token, (int, str)):
        return None
    try:
        revision = int(token)
    except ValueError:
        return None
    return revision if revision > 0 else None


def _check_run_id(run_id: str) -> None:
    """The rendezvous id is the job's name: the one job-name rule (agent/shared/contract.py)."""
    try:
        validate_job_name(run_id)
    except ValueError as exc:
        raise ValueError(f"rendezvous id: {exc}; pass --rdzv-id JOB") from None


def _disable_shared_tcp_store() -> None:
    """Make torchrun give each round's workers their own TCPStore (see the module docstring)."""
    previous = os.environ.get(SHARE_STORE_ENV)
    if previous == "1":
        return
    if previous is not None:
        logger.warning(
            "%s=%s overridden to 1: a TCPStore shared across restart rounds breaks gloo/NCCL "
            "re-initialisation after a restart", SHARE_STORE_ENV, previous,
        )
    os.environ[SHARE_STORE_ENV] = "1"


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torchrun's creator for ``--rdzv-backend etcd3``: validate, connect, and build the dynamic handler."""
    config = Etcd3RendezvousConfig.from_params(params)
    _check_run_id(params.run_id)
    kind = str(params.config.get(_ROUND_KEY, "dynamic")).strip().lower()
    if kind not in ("dynamic", "native"):
        raise ValueError(f"rdzv-conf round={kind!r}: expected dynamic (torch's rendezvous, the default) or native "
                         f"(a key per node, one closing transaction: for jobs of hundreds of nodes)")
    client = connect(config)
    job_prefix = rdzv_key(params.run_id, prefix=config.key_prefix)
    store = Etcd3Store(client, f"{job_prefix}/store", endpoint=config.netloc)
    _disable_shared_tcp_store()
    logger.info("etcd3 rendezvous (%s round) for %r at %s under %s", kind, params.run_id, config.etcd.describe(),
                job_prefix)
    if kind == "native":
        from trainwarden.agent.rendezvous.native_handler import NativeRendezvousHandler

        handler = NativeRendezvousHandler(client, store, params, key_prefix=config.key_prefix)
        keep_training_through_etcd_outages(handler)
        return handler
    backend = Etcd3RendezvousBackend(client, params.run_id, key_prefix=config.key_prefix, endpoint=config.netloc)
    handler = create_handler(store, backend, params)
    keep_training_through_etcd_outages(handler)
    close_when_members_rejoin(handler)
    return handler


def keep_training_through_etcd_outages(handler: RendezvousHandler, *, clock=time.monotonic) -> None:
    """A running round trains on while etcd cannot serve (quorum lost, every member down).

    torchrun's agent asks ``num_nodes_waiting()`` every monitor interval; an error there ends the agent and
    with it the workers, although they need nothing from etcd between rounds. While etcd is away the
    answer is 0 (no node can join anyway), said once in the log; a round that has to be formed (a restart,
    a node joining) still waits for etcd in ``next_rendezvous``."""
    ask = handler.num_nodes_waiting
    down_since: list[float] = []

    def num_nodes_waiting() -> int:
        try:
            waiting = ask()
        except RendezvousConnectionError as exc:
            if not down_since:
                down_since.append(clock())
                logger.warning("etcd cannot serve the rendezvous (%s); the running round trains on, and no "
                               "node can join or leave until etcd is back", exc)
            return 0
        if down_since:
            logger.warning("etcd serves the rendezvous again after %.0f s", clock() - down_since.pop())
        return waiting

    handler.num_nodes_waiting = num_nodes_waiting  # type: ignore[method-assign]

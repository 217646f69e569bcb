"""One way to open an etcd v3 client, for every part of trainwarden that talks to etcd.

``EtcdConfig`` says where etcd is and how to speak to it: one or more client endpoints, TLS (a CA bundle, a
client key and certificate for mutual TLS) and authentication (user and password). ``open_etcd(config)``
turns it into a client. The rendezvous backend, the job records, the incident copies, the node daemon and
every CLI command open their clients here, so a TLS or auth setting reaches all of them or none.

Two deliberate differences from ``etcd3.client()``:

- ``python3-etcd3`` marks an endpoint as failed for 300 s after any failed call, so a brief etcd restart
  would turn into five minutes of errors. With one endpoint it is never marked failed (``time_retry=0``);
  with several, a failed one is skipped for ``FAILOVER_RETRY_S`` while the client fails over to the others.
  gRPC's reconnect back-off is capped at 1 s (its default grows to two minutes).
- A connect probe: an endpoint that does not answer within ``connect_timeout`` is skipped, and with none
  answering ``open_etcd`` raises ``EtcdUnavailable`` at once instead of on the first read.

No torch here: the agent and the CLI import it.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import etcd3
import grpc

from trainwarden.agent.etcd import watcher_close

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

__all__ = [
    "ETCD_CLIENT_ERRORS", "INSECURE_ENV", "RETIRED_PASSWORD_ENV", "SECURITY_ENV", "EtcdAccessDenied", "EtcdConfig", "EtcdError",
    "EtcdSecurity", "EtcdUnavailable", "GRPC_OPTIONS", "describe_etcd_error", "is_auth_error", "is_loopback_host",
    "open_client", "open_etcd",
    "read_password_file", "split_endpoint", "with_failover",
]

GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # a member failed over from keeps its connection only this long unused (gRPC's default is 30 minutes): a
    # client holds a socket to each member it ever used, 5 more fds a `trainwarden run` after a quorum loss
    ("grpc.client_idle_timeout_ms", 60_000),
]
FAILOVER_RETRY_S = 2.0
"""With several endpoints, how long a failed one is skipped before it is tried again."""

ETCD_CLIENT_ERRORS: tuple[type[BaseException], ...] = (etcd3.Etcd3Exception, grpc.RpcError)
"""What the etcd3 client raises when etcd cannot serve a request (down, unreachable, auth, timeout)."""


class EtcdError(Exception):
    """Base of trainwarden's etcd errors."""


class EtcdUnavailable(EtcdError, ConnectionError):
    """etcd did not answer. Retryable once etcd is back."""


class EtcdAccessDenied(EtcdError):
    """etcd answered but refused the credentials or the permission. Not retryable: fix the settings."""


def split_endpoint(endpoint: str) -> tuple[str, int, str]:
    """``[http[s]://]host:port`` -> (host, port, scheme); ValueError with an example otherwise."""
    scheme = "http"
    for prefix in ("http://", "https://"):
        if endpoint.startswith(prefix):
            scheme, endpoint = prefix[:-3], endpoint[len(prefix):]
    host, _, port = endpoint.rstrip("/").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"etcd endpoint {endpoint!r}: expected HOST:PORT, e.g. 127.0.0.1:2379")
    return host.strip("[]"), int(port), scheme


@dataclass(frozen=True, kw_only=True)
class EtcdConfig:
    """Where etcd is and how to speak to it (see the module docstring)."""

    endpoints: tuple[str, ...]
    """Client endpoints, ``[http[s]://]host:port`` each; any one that answers is used."""
    ca_cert: str | None = None
    """CA bundle that signed etcd's server certificate (TLS); the system roots when None and TLS is on."""
    cert_key: str | None = None
    """Client private key for mutual TLS (with ``cert_cert``)."""
    cert_cert: str | None = None
    """Client certificate for mutual TLS (with ``cert_key``)."""
    user: str | None = None
    """etcd user (with ``password``)."""
    password: str | None = field(default=None, repr=False)
    """etcd password of ``user``; never logged, never put on a command line."""
    password_file: str | None = None
    """File holding the password (instead of ``password``; one trailing newline is ignored)."""
    timeout: float = 5.0
    """Deadline of each request, in seconds."""
    connect_timeout: float = 2.0
    """How long the probe waits for an endpoint to answer."""

    def __post_init__(self) -> None:
        if isinstance(self.endpoints, str):
            object.__setattr__(self, "endpoints", tuple(e.strip() for e in self.endpoints.split(",") if e.strip()))
        if not self.endpoints:
            raise ValueError("no etcd endpoint given: expected HOST:PORT[,HOST:PORT...], e.g. 127.0.0.1:2379")
        schemes = {split_endpoint(e)[2] for e in self.endpoints}
        if len(schemes) > 1:
            raise ValueError(f"etcd endpoints {', '.join(self.endpoints)} mix http:// and https://; use one")
        if bool(self.cert_key) != bool(self.cert_cert):
            raise ValueError("cert_key and cert_cert (client key and certificate) go together; give both")
        for name in ("ca_cert", "cert_key", "cert_cert"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ValueError(f"{name}={path!r}: no such file")
        if self.password_file:
            if self.password:
                raise ValueError("password and password_file both given; give one")
            object.__setattr__(self, "password", read_password_file(self.password_file))
        if bool(self.user) != bool(self.password):
            raise ValueError("user and password go together; give both or neither")
        for name in ("timeout", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive number of seconds")

    @property
    def secure(self) -> bool:
        """TLS on: an https:// endpoint or any TLS file given."""
        return any(e.startswith("https://") for e in self.endpoints) or bool(self.ca_cert or self.cert_cert)

    @property
    def netlocs(self) -> list[str]:
        """``host:port`` of every endpoint, as gRPC dials them (IPv6 in brackets)."""
        out = []
        for endpoint in self.endpoints:
            host, port, _ = split_endpoint(endpoint)
            out.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        return out

    def describe(self) -> str:
        """The endpoints for messages (never the password)."""
        return ",".join(self.netlocs)


def read_password_file(path: str) -> str:
    """The password a file holds (one trailing newline dropped); ValueError naming the file otherwise."""
    try:
        with open(path, "rb") as f:
            raw = f.read(4097)
    except OSError as exc:
        raise ValueError(f"password_file={path!r}: cannot read it ({exc.strerror or exc})") from None
    if len(raw) > 4096:
        raise ValueError(f"password_file={path!r}: longer than 4096 bytes; is it the right file?")
    text = raw.decode("utf-8", errors="strict").removesuffix("\n").removesuffix("\r")
    if not text:
        raise ValueError(f"password_file={path!r} is empty")
    return text


SECURITY_ENV = {
    "ca_cert": "TRAINWARDEN_ETCD_CA",
    "cert_cert": "TRAINWARDEN_ETCD_CERT",
    "cert_key": "TRAINWARDEN_ETCD_KEY",
    "user": "TRAINWARDEN_ETCD_USER",
    "password_file": "TRAINWARDEN_ETCD_PASSWORD_FILE",
}
"""The environment variable behind each ``EtcdSecurity`` setting (a flag given wins)."""
INSECURE_ENV = "TRAINWARDEN_INSECURE_ETCD"
"""Set to 1: ``--insecure-etcd``."""
RETIRED_PASSWORD_ENV = "TRAINWARDEN_ETCD_PASSWORD"
"""A password in the environment is copied into every worker's: refused; use the password file."""


@dataclass(frozen=True, kw_only=True)
class EtcdSecurity:
    """TLS and auth settings for an etcd named elsewhere: what ``--etcd-ca/--etcd-cert/--etcd-key/
    --etcd-user/--etcd-password-file`` (or ``TRAINWARDEN_ETCD_*``) say. Holds the password's file,
    never the password: it can be handed to torchrun's rendezvous on a command line."""

    ca_cert: str | None = None
    cert_cert: str | None = None
    cert_key: str | None = None
    user: str | None = None
    password_file: str | None = None
    insecure: bool = False
    """Allow plain http to an etcd that is not on loopback (``--insecure-etcd``): refused otherwise."""

    @classmethod
    def from_env(cls, environ=os.environ, insecure: bool | None = None, **given: str | None) -> "EtcdSecurity":
        """The settings ``given`` (flags), each missing one from its environment variable."""
        if environ.get(RETIRED_PASSWORD_ENV):
            raise ValueError(f"{RETIRED_PASSWORD_ENV} is not read: a password in the environment reaches every "
                             f"worker's; write it to a file only you can read and set "
                             f"{SECURITY_ENV['password_file']} (or --etcd-password-file) to its path")
        values = {name: given.get(name) or environ.get(var) or None for name, var in SECURITY_ENV.items()}
        if insecure is None:
            insecure = environ.get(INSECURE_ENV, "").strip().lower() in ("1", "true", "yes", "on")
        return cls(**values, insecure=bool(insecure))

    @property
    def given(self) -> bool:
        return any((self.ca_cert, self.cert_cert, self.cert_key, self.user, self.password_file))

    def config(self, endpoints, **options) -> EtcdConfig:
        """The client settings for ``endpoints`` (ValueError naming the flag at fault)."""
        if bool(self.user) != bool(self.password_file):
            raise ValueError("--etcd-user and --etcd-password-file go together (or TRAINWARDEN_ETCD_USER and "
                             "TRAINWARDEN_ETCD_PASSWORD_FILE); give both or neither")
        try:
            config = EtcdConfig(endpoints=endpoints, ca_cert=self.ca_cert, cert_cert=self.cert_cert,
                                cert_key=self.cert_key, user=self.user, password_file=self.password_file, **options)
        except ValueError as exc:
            raise ValueError(_flag_names(str(exc))) from None
        exposed = [netloc for netloc, endpoint in zip(config.netlocs, config.endpoints)
                   if not is_loopback_host(split_endpoint(endpoint)[0])]
        if exposed and not config.secure and not self.insecure:
            raise ValueError(f"etcd at {', '.join(exposed)} over plain http: anyone who can reach it reads every "
                             "job's keys and may write jobs/ (which starts code on every node) or a rendezvous. Give "
                             "an https:// endpoint with --etcd-ca, --etcd-cert and --etcd-key (deploy/etcd/README.md "
                             "makes them), or --insecure-etcd (TRAINWARDEN_INSECURE_ETCD=1) on a network you trust")
        return config

    def rdzv_conf(self) -> dict[str, str]:
        """The etcd3 rendezvous options that carry these settings (the password's file, not the password)."""
        conf = {"ca_cert": self.ca_cert, "cert_cert": self.cert_cert, "cert_key": self.cert_key, "user": self.user,
                "password_file": self.password_file}
        return {k: v for k, v in conf.items() if v}


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` is this machine's loopback (a name other than localhost is not resolved: it counts as
    remote)."""
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _flag_names(message: str) -> str:
    for name, flag in (("password_file", "--etcd-password-file"), ("ca_cert", "--etcd-ca"),
                       ("cert_cert", "--etcd-cert"), ("cert_key", "--etcd-key"), ("user", "--etcd-user")):
        message = message.replace(name, flag)
    return message


def _credentials(config: EtcdConfig) -> grpc.ChannelCredentials | None:
    if not config.secure:
        return None
    return grpc.ssl_channel_credentials(root_certificates=_read(config.ca_cert), private_key=_read(config.cert_key),
                                        certificate_chain=_read(config.cert_cert))


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def open_etcd(config: EtcdConfig) -> etcd3.MultiEndpointEtcd3Client:
    """A client for ``config``, on an endpoint that answered within ``connect_timeout``.

    ``EtcdUnavailable`` when none answers; ``EtcdAccessDenied`` when etcd refuses the credentials.
    """
    watcher_close.install()  # a failed-over client's old watcher ends its thread (agent/etcd/watcher_close.py)
    creds = _credentials(config)
    retry = 0.0 if len(config.endpoints) == 1 else FAILOVER_RETRY_S
    endpoints, answering = [], None
    for netloc in config.netlocs:
        host, _, port = netloc.rpartition(":")
        endpoint = etcd3.Endpoint(host.strip("[]"), int(port), secure=creds is not None, creds=creds,
                                  time_retry=retry, opts=GRPC_OPTIONS)
        endpoints.append(endpoint)
        if answering is None:
            ready = grpc.channel_ready_future(endpoint.channel)
            try:
                ready.result(timeout=config.connect_timeout)
                answering = endpoint
            except grpc.FutureTimeoutError:
                ready.cancel()
    if answering is None:
        for endpoint in endpoints:
            endpoint.close()
        raise EtcdUnavailable(f"no answer from etcd at {config.describe()} within {config.connect_timeout:.1f}s")
    # the client authenticates on its current endpoint: start on the one that answered
    ordered = [answering] + [e for e in endpoints if e is not answering]
    try:
        client = etcd3.MultiEndpointEtcd3Client(endpoints=[answering], timeout=config.timeout, user=config.user,
                                                password=config.password, failover=len(ordered) > 1)
    except ETCD_CLIENT_ERRORS as exc:
        for endpoint in endpoints:
            endpoint.close()
        if is_auth_error(exc):
            raise EtcdAccessDenied(f"etcd at {config.describe()} refused the credentials of user {config.user!r}: "
                                   f"{describe_etcd_error(exc)}") from exc
        raise EtcdUnavailable(f"etcd at {config.describe()} did not complete the session: "
                              f"{describe_etcd_error(exc)}") from exc
    for endpoint in ordered[1:]:
        client.endpoints[endpoint.netloc] = endpoint
    if creds is None:  # gRPC refuses call credentials on a plaintext channel; the token goes in the metadata anyway
        client.call_credentials = None
    return client


def open_client(host: str, port: int, *, timeout: float, connect_timeout: float = 2.0, user: str | None = None,
                password: str | None = None) -> etcd3.MultiEndpointEtcd3Client:
    """A plain-http client for one ``host:port`` (the embedded etcd's probe); see ``open_etcd``."""
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return open_etcd(EtcdConfig(endpoints=(netloc,), timeout=timeout, connect_timeout=connect_timeout, user=user,
                                password=password))


def is_auth_error(exc: BaseException) -> bool:
    """etcd refused the credentials or the permission (not retryable), as opposed to being unreachable."""
    text = describe_etcd_error(exc).lower()
    return "authentication failed" in text or "permission denied" in text or "unauthenticated" in text \
        or "invalid auth token" in text or "user name is empty" in text


def with_failover(client, op: Callable[[], _T], *, sleep: Callable[[float], object] = time.sleep) -> _T:
    """``op()``, tried once more on each other member when a member refuses the connection.

    ``python3-etcd3`` marks the member that failed and uses the next one only for the *next* call; the
    failed call itself raises. Only ``ConnectionFailedError`` (UNAVAILABLE: the request never reached etcd)
    is retried, so an operation is never applied twice; a timeout, which may have been applied, is raised.
    ``NoServerAvailableError`` (every member marked failed: a member killed and the others briefly unavailable
    while they elect a leader) is retried once after the marks lapse (``FAILOVER_RETRY_S``): the client chose no
    member, so nothing was sent. In the hour's soak a save's commit was refused on it when a member was killed.
    """
    attempts = max(1, len(getattr(client, "endpoints", None) or ()))
    waited = attempts == 1  # one member is never marked failed
    attempt = 0
    while True:
        try:
            return op()
        except etcd3.exceptions.ConnectionFailedError:
            attempt += 1
            if attempt >= attempts:
                raise
            logger.warning("etcd member failed; retrying on the next of %d", attempts)
        except etcd3.exceptions.NoServerAvailableError:
            if waited:
                raise
            waited = True
            logger.warning("every etcd member was marked failed; trying again in %.0f s", FAILOVER_RETRY_S)
            sleep(FAILOVER_RETRY_S)


def read_json_prefix(client, prefix: str) -> dict[str, dict | None]:
    """Every key under ``prefix``, by the rest of its name, with its JSON value (None where it is not JSON)."""
    out: dict[str, dict | None] = {}
    for value, meta in with_failover(client, lambda: list(client.get_prefix(prefix))):
        try:
            out[meta.key.decode()[len(prefix):]] = json.loads(value)
        except ValueError:
            out[meta.key.decode()[len(prefix):]] = None
    return out


def refresh_lease(client, lease) -> bool:
    """Keep ``lease`` alive; False when etcd says it has already expired."""
    responses = with_failover(client, lambda: list(client.refresh_lease(lease.id)))
    return bool(responses) and int(getattr(responses[-1], "TTL", 0)) > 0


def describe_etcd_error(exc: BaseException) -> str:
    """One line for an etcd3/gRPC error (gRPC errors carry the useful part in ``details()``)."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        try:
            return f"{exc.code().name}: {exc.details()}"
        except Exception:  # a bare RpcError without call information
            pass
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

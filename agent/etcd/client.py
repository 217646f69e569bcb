"""One way to open an etcd v3 client, for every part of trainwarden that talks to etcd.

``python3-etcd3``'s ``etcd3.client()`` marks its only endpoint as failed for 300 s after any failed call,
so a brief etcd restart would turn into five minutes of errors for the rendezvous, the job records and
the incident copies alike. ``open_client`` builds the endpoint with ``time_retry=0`` (never blacklisted),
caps gRPC's reconnect backoff at 1 s, and checks within ``connect_timeout`` that the server answers, so a
wrong endpoint fails at once with ``EtcdUnreachable`` instead of on the first read.
No torch here: the agent and the CLI import it.
"""

from __future__ import annotations

import etcd3
import grpc

__all__ = ["EtcdUnreachable", "GRPC_OPTIONS", "open_client", "split_endpoint"]

GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class EtcdUnreachable(ConnectionError):
    """No answer from etcd within the connect timeout. Retryable once etcd is up."""


def split_endpoint(endpoint: str) -> tuple[str, int, str]:
    """``[http[s]://]host:port`` -> (host, port, scheme); ValueError with an example otherwise."""
    scheme = "http"
    for prefix in ("http://", "https://"):
        if endpoint.startswith(prefix):
            scheme, endpoint = prefix[:-3], endpoint[len(prefix):]
    host, _, port = endpoint.rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"etcd endpoint {endpoint!r}: expected HOST:PORT, e.g. 127.0.0.1:2379")
    return host.strip("[]"), int(port), scheme


def open_client(host: str, port: int, *, timeout: float, connect_timeout: float = 2.0,
                creds: grpc.ChannelCredentials | None = None, user: str | None = None,
                password: str | None = None) -> etcd3.MultiEndpointEtcd3Client:
    """A client whose endpoint answered within ``connect_timeout``; ``EtcdUnreachable`` otherwise.

    ``timeout`` bounds every later call. Errors of the session itself (bad credentials) propagate.
    """
    endpoint = etcd3.Endpoint(host, port, secure=creds is not None, creds=creds, time_retry=0.0,
                              opts=GRPC_OPTIONS)
    ready = grpc.channel_ready_future(endpoint.channel)
    try:
        ready.result(timeout=connect_timeout)
    except grpc.FutureTimeoutError:
        ready.cancel()
        endpoint.close()
        raise EtcdUnreachable(f"no answer from etcd at {host}:{port} within {connect_timeout:.1f}s") from None
    try:
        return etcd3.MultiEndpointEtcd3Client(endpoints=[endpoint], timeout=timeout, user=user, password=password)
    except BaseException:
        endpoint.close()
        raise

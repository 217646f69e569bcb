"""The agent's health on a TCP port, for probes that cannot reach a unix socket (Kubernetes' gRPC probes).

Kubelet's native gRPC probe (``grpc: {port: N}``) dials the pod's IP; the agent's gRPC server listens on a
unix socket only. ``HealthEndpoint`` is a second, small gRPC server on ``host:port`` with one method, the
standard ``grpc.health.v1.Health/Check``, answered by the telemetry server's own ``HealthServicer``: what it
says is what the agent is, SERVING while the telemetry server serves and NOT_SERVING from the moment it stops.

Nothing else is served there (no telemetry stream, no ``Status``, no ``Commit``), so opening the port to the
pod network discloses one bit. ``Watch``, the health service's other method, is left out on purpose: each
Watch holds a server thread for as long as its client keeps it open, and a few idle Watch streams from
anywhere on the network would starve the probes. Kubelet, ``grpc_health_probe`` and ``trainwarden agent
--check`` call ``Check`` only; a ``Watch`` gets UNIMPLEMENTED.

Off unless ``health_port`` is set: on bare metal ``trainwarden agent --check`` asks the unix socket.
"""

from __future__ import annotations

import errno
import logging
import socket
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2

__all__ = ["HealthEndpoint", "HealthEndpointError"]

log = logging.getLogger(__name__)

_CHECK_ONLY_LIMIT = 4096
"""Bytes a request may have: a HealthCheckRequest is a service name."""


class HealthEndpointError(Exception):
    """The health port cannot be bound (taken, or not an address of this host). Retrying will not help."""


class HealthEndpoint:
    """``grpc.health.v1.Health/Check`` on ``host:port``, answered by a given ``HealthServicer``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """``port`` 0 picks a free one (``port`` tells which once started)."""
        if not 0 <= port <= 65535:
            raise ValueError(f"health port {port} is not a TCP port")
        self.host = host
        self._requested_port = port
        self._port: int | None = None
        self._server: grpc.Server | None = None

    @property
    def port(self) -> int:
        """The port being served; the requested one before ``start``."""
        return self._port if self._port is not None else self._requested_port

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def start(self, servicer: health.HealthServicer) -> "HealthEndpoint":
        """Bind and serve ``servicer.Check``; ``HealthEndpointError`` if the address cannot be bound."""
        if self._server is not None:
            raise HealthEndpointError(f"health endpoint already serving {self.address}")
        _check_bindable(self.host, self._requested_port)  # gRPC's own failure names no cause
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health"),
            maximum_concurrent_rpcs=16,
            # no SO_REUSEPORT: a second agent on the same port must fail, not share it and answer for the first
            options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", _CHECK_ONLY_LIMIT)],
        )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(health.SERVICE_NAME, {
            "Check": grpc.unary_unary_rpc_method_handler(
                servicer.Check, request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
        }),))
        try:
            port = server.add_insecure_port(self.address)
        except RuntimeError:  # taken between the check and now
            port = 0
        if port == 0:
            raise HealthEndpointError(f"cannot serve the health check on {self.address}; choose another health port")
        server.start()
        self._server, self._port = server, port
        log.info("health check served on %s", self.address, extra={"address": self.address})
        return self

    def stop(self, grace: float | None = 0.5) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace).wait()


def _check_bindable(host: str, port: int) -> None:
    """Bind ``host:port`` once ourselves, as gRPC will (with SO_REUSEADDR), to say why it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
    except OSError as exc:
        hint = {errno.EADDRINUSE: "another process holds it: stop it or choose another health port",
                errno.EADDRNOTAVAIL: "it is not an address of this host: check the health host setting",
                errno.EACCES: "a port below 1024 needs privileges: choose a higher health port"}
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise HealthEndpointError(f"cannot serve the health check on {where}: {exc.strerror or exc}; "
                                  f"{hint.get(exc.errno, 'check the health host and port settings')}") from None
    finally:
        probe.close()

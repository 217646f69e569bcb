"""Which of this host's addresses its peers should use: the one on the interface that routes to etcd.

A multi-node job must advertise an address its peers can reach, and gloo must bind it. The host name is
not that address: it may resolve to 127.0.1.1 (Debian), to an interface the peers cannot reach, or be shared
by containers and simulated nodes. The kernel's routing table knows which interface reaches etcd; a UDP
socket ``connect`` asks it without sending a packet.
"""

from __future__ import annotations

import socket

import psutil

__all__ = ["interface_of", "route_address"]


def route_address(host: str, port: int = 2379) -> str:
    """This host's source address for traffic to ``host`` (no packet is sent); OSError when there is no route."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the interface holding ``address`` (e.g. ``eth0``), or None."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None

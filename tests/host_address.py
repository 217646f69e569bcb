"""An address of this host that is not loopback, for tests that a server listens on loopback only (issue 44).

``other_address()`` yields the first non-loopback IPv4 address of an interface that is up; a machine with none
(a container with only ``lo``) gets one on a dummy link made for the test and removed after it (root only).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import socket
import subprocess
from typing import Iterator

import psutil

__all__ = ["connects", "other_address", "unavailable"]

DUMMY_LINK = "twtest0"
DUMMY_ADDRESS = "198.51.100.77"  # TEST-NET-2: routed nowhere


def _existing() -> str | None:
    stats = psutil.net_if_stats()
    for name, addresses in psutil.net_if_addrs().items():
        if not stats.get(name) or not stats[name].isup:
            continue
        for address in addresses:
            if address.family == socket.AF_INET and not ipaddress.ip_address(address.address).is_loopback:
                return address.address
    return None


def unavailable() -> str | None:
    """Why this machine has no other address to offer (None: it has, or can make one)."""
    if _existing() is None and (os.geteuid() != 0 or shutil.which("ip") is None):
        return "no non-loopback address on this host, and making a dummy link needs root and iproute2's ip"
    return None


@contextlib.contextmanager
def other_address() -> Iterator[str]:
    found = _existing()
    if found is not None:
        yield found
        return
    subprocess.run(["ip", "link", "add", DUMMY_LINK, "type", "dummy"], check=True, capture_output=True)
    try:
        subprocess.run(["ip", "addr", "add", f"{DUMMY_ADDRESS}/32", "dev", DUMMY_LINK], check=True, capture_output=True)
        subprocess.run(["ip", "link", "set", DUMMY_LINK, "up"], check=True, capture_output=True)
        yield DUMMY_ADDRESS
    finally:
        subprocess.run(["ip", "link", "del", DUMMY_LINK], capture_output=True)


def connects(host: str, port: int, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to ``host:port`` is accepted."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False

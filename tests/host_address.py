"""An address of this host that is not loopback, for tests that a server listens on loopback only (issue 44).

``other_address()`` yields an address on a link (one end of a veth pair) made for the test and removed after it (root only):
TEST-NET-2, routed nowhere. Never the host's own interfaces' addresses: tests send nothing to an address that is
not loopback or the project's own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
from typing import Iterator


__all__ = ["connects", "other_address", "unavailable"]

DUMMY_LINK = "twtest0"
DUMMY_ADDRESS = "198.51.100.77"  # TEST-NET-2: routed nowhere


def unavailable() -> str | None:
    """Why this machine has no other address to offer (None: it has, or can make one)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "making a link (a veth pair) with a non-loopback address needs root and iproute2's ip"
    return None


@contextlib.contextmanager
def other_address() -> Iterator[str]:
    subprocess.run(["ip", "link", "del", DUMMY_LINK], capture_output=True)  # left by a test that was killed
    # a veth pair (this kernel may lack the dummy type; the test beds use veth already)
    subprocess.run(["ip", "link", "add", DUMMY_LINK, "type", "veth", "peer", "name", DUMMY_LINK + "p"], check=True,
                   capture_output=True)
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

"""Fetching a peer token: the client's half of agent/telemetry/peer_credentials.py.

A process that asks the node agent something on its own behalf (a worker's stream or commit, ``trainwarden status``)
first connects to ``<socket>.cred``; the agent answers with a single-use token bound to the kernel's pid and uid of
that connection, and the process sends it with its request (in the Hello, a field, or the call's metadata under
``PEER_TOKEN_METADATA``). Shared by the runtime and the agent's commands, so it lives in this leaf package.
"""

from __future__ import annotations

import socket

from trainwarden.agent.shared.contract import PEER_TOKEN_METADATA, peer_credential_socket

__all__ = ["fetch_peer_token", "token_metadata"]


def fetch_peer_token(socket_path: str, timeout: float = 1.0) -> str:
    """A single-use token from the agent's ``<socket>.cred``, bound by the kernel to this process's pid and uid;
    "" when there is none to be had (no agent, an older one)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            conn.connect(peer_credential_socket(str(socket_path)))
            return conn.recv(128).decode("ascii", errors="replace").strip()
    except OSError:
        return ""


def token_metadata(socket_path: str) -> list[tuple[str, str]]:
    """gRPC call metadata carrying a fresh peer token (empty when none could be fetched)."""
    token = fetch_peer_token(socket_path)
    return [(PEER_TOKEN_METADATA, token)] if token else []

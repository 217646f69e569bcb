"""The workers' TCPStore server of a round, listening on the job's address only (issue 44, item 6).

torch's ``TCPStore(host, port, is_master=True)`` listens on every interface whatever ``host`` says, and serves anyone
who connects: any process that reaches the host read and wrote the workers' keys (the process group's addresses,
barriers). ``serve(host)`` binds the listening socket to ``host`` itself (loopback in a one-node run; the address the
node advertises in a job of several) and hands it to torch (``master_listen_fd``: the store owns and closes it).

What it does not do: authenticate. TCPStore has no credentials, and a random key prefix per round would be no
secret, since any client may ask the store for every key (``list_keys``, ``num_keys``). In a job of several nodes,
every process that reaches the advertised address can still use the store (docs/SECURITY.md).
"""

from __future__ import annotations

import os
import socket

from torch.distributed import TCPStore

__all__ = ["LISTEN_BACKLOG", "bind_listener", "serve"]

LISTEN_BACKLOG = 2048
"""Pending connections the kernel keeps: every worker of the job dials at once after a round closes."""


def bind_listener(host: str) -> socket.socket:
    """A TCP socket listening on ``host`` (a name is resolved: its first address), on a port the kernel picks."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(LISTEN_BACKLOG)
    except BaseException:
        listener.close()
        raise
    return listener


def serve(host: str) -> TCPStore:
    """A TCPStore server that only ``host``'s address reaches; its ``port`` is the one to publish."""
    listener = bind_listener(host)
    port = listener.getsockname()[1]
    fd = listener.detach()  # the store owns the descriptor from here and closes it when it stops
    try:
        return TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise

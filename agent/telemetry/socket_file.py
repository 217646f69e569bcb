"""The telemetry server's socket file: a path that fits, a directory for it, nothing stale on it, and a mode that
is private from the moment the socket exists.

The socket's parent directory is created (0770) and the socket is bound under a umask of 0117, so it is 0660 from the
moment it exists. A stale socket file left by a killed agent (nobody accepts on it) is removed; a live socket or any
other file at the path is an error (`TelemetryServerError`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from pathlib import Path

__all__ = ["MAX_UNIX_PATH", "TelemetryServerError", "checked_socket_path", "prepare_socket_path", "private_umask"]

MAX_UNIX_PATH = 102  # 107 bytes, less the '.cred' of the peer-credential socket beside it


class TelemetryServerError(Exception):
    """The server cannot start (bad socket path, path taken by a non-socket). Retrying will not help."""


def checked_socket_path(socket_path: str | os.PathLike) -> Path:
    """The absolute path, when it is short enough for a unix socket (and its ``.cred`` beside it)."""
    path = Path(socket_path).absolute()
    if len(os.fsencode(str(path))) > MAX_UNIX_PATH:
        raise TelemetryServerError(
            f"socket path {path} is longer than {MAX_UNIX_PATH} bytes; choose a shorter path "
            "(e.g. under /run/trainwarden)")
    return path


def prepare_socket_path(path: Path) -> None:
    """The socket's directory made (0770), and a stale socket at the path removed."""
    path.parent.mkdir(mode=0o770, parents=True, exist_ok=True)
    _remove_stale_socket(path)


@contextlib.contextmanager
def private_umask():
    """Files and sockets created inside are 0660 at most."""
    old = os.umask(0o117)
    try:
        yield
    finally:
        os.umask(old)


def _remove_stale_socket(path: Path) -> None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise TelemetryServerError(f"{path} exists and is not a socket; remove it or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()  # nobody listens: left behind by an agent that was killed
        return
    finally:
        probe.close()
    raise TelemetryServerError(f"another process is serving on {path}; stop it or choose another path")

"""Who is on the other end of a telemetry stream, from the kernel, not from what the worker says.

The gRPC stream's Hello carries the worker's pid, and the agent may later SIGKILL that pid (a rank that
cannot obey an abort). A pid a client states is a claim: anyone who can reach the socket could name any
process, and a worker in a container without the host's pid namespace states a pid the agent cannot use.
gRPC's Python API does not expose the peer's credentials of a unix-socket connection, so the agent keeps a
second, tiny unix socket beside the telemetry socket (``peer_credential_socket(path)``: ``<path>.cred``).
Before each stream the worker connects to it; the agent reads the kernel's ``SO_PEERCRED`` of that
connection (pid, uid, gid, in the agent's pid namespace), notes the process's start time, and answers with a
single-use token; the worker puts the token in its Hello. The Hello's pid is then checked against the
kernel's, and the verified identity, not the claim, is what the agent may signal (agent/node/actions.py
re-checks the start time and that the process belongs to the job before every signal).

A token is valid for `ttl_s` and for one stream. A worker that cannot fetch one (an older runtime, the
socket gone) still streams telemetry, marked unverified: the agent never signals it.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

from trainwarden.agent.shared.contract import peer_credential_socket

log = logging.getLogger(__name__)

__all__ = ["PeerCredential", "PeerCredentialServer"]

_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}


@dataclass(frozen=True)
class PeerCredential:
    """A process the kernel vouched for."""

    pid: int
    uid: int
    gid: int
    started: float
    """psutil's create_time at verification: a later process with the same pid differs."""


class PeerCredentialServer:
    """Answers each connection on ``<telemetry socket>.cred`` with a token bound to the peer's credentials."""

    def __init__(self, telemetry_socket: str | os.PathLike, *, ttl_s: float = 120.0, max_tokens: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(peer_credential_socket(str(telemetry_socket)))
        self._ttl, self._max, self._clock = ttl_s, max_tokens, clock
        self._tokens: dict[str, tuple[PeerCredential, float]] = {}
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o117)  # created 0660, never world-writable, not even for an instant
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        sock.listen(64)
        sock.settimeout(0.5)
        self._sock = sock
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, name="trainwarden-peer-cred", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            try:  # a connection wakes the accept at once, rather than at its next 0.5 s timeout
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:
                    wake.settimeout(0.5)
                    wake.connect(str(self.path))
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(2.0)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def take(self, token: str) -> PeerCredential | None:
        """The credentials a token was issued for; None for an unknown, used or expired token."""
        with self._lock:
            entry = self._tokens.pop(token, None)
        if entry is None or self._clock() - entry[1] > self._ttl:
            return None
        return entry[0]

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                if not self._stop.is_set():
                    log.exception("peer credential socket failed; workers stream unverified")
                return
            if self._stop.is_set():  # stop's wake-up call
                conn.close()
                return
            try:
                with conn:
                    conn.settimeout(1.0)
                    pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
                    token = self._issue(pid, uid, gid)
                    conn.sendall((token + "\n").encode() if token else b"\n")
            except OSError as exc:
                log.debug("peer credential exchange failed: %s", exc)

    def _issue(self, pid: int, uid: int, gid: int) -> str:
        try:
            started = psutil.Process(pid).create_time()
        except psutil.Error:
            return ""
        token = secrets.token_hex(16)
        now = self._clock()
        with self._lock:
            if len(self._tokens) >= self._max:  # drop the expired, then the oldest
                for key in [k for k, (_, at) in self._tokens.items() if now - at > self._ttl]:
                    del self._tokens[key]
                while len(self._tokens) >= self._max:
                    del self._tokens[next(iter(self._tokens))]
            self._tokens[token] = (PeerCredential(pid=pid, uid=uid, gid=gid, started=started), now)
        return token

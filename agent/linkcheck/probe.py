"""The link probe: a small TCP server each node of a multi-node job runs on its job address, and the client
side that measures one link with it.

A coordinator (``trainwarden linkcheck``, or a node that saw a communication regression) asks node A's server
to *probe* node B: A streams bytes into B's sink for a bounded time (A→B bandwidth), pulls bytes from B's source
for as long (B→A), and times small round trips (latency). Because A and B are the job's own nodes and their
job addresses, the probe crosses the links the job's collectives cross, which the ranks' own numbers cannot
name: a collective is as slow as its slowest link, on every rank.

What one TCP stream achieves is a relative measure, not a NIC's line rate: the verdict (``verdict.py``)
compares the job's links with each other.

The wire format: a client sends one JSON line ``{"op": ..., "token": ...}``; bulk bytes travel as frames (a
4-byte big-endian length, then that many bytes; a zero length ends the stream); answers are JSON lines. The
server answers only requests that carry its token (a random secret it publishes in its node record in etcd,
readable by whoever may read the job), probes only peers the caller names with their own token, and caps
every transfer: a stray connection can neither drive traffic nor hold the server.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["LinkSample", "ProbeError", "ProbeServer", "measure_link", "request_probe"]

log = logging.getLogger(__name__)

_FRAME = struct.Struct("!I")
_CHUNK = 256 * 1024
_PAYLOAD = os.urandom(_CHUNK)  # incompressible, made once
MAX_SECONDS = 5.0
"""The longest transfer one request may ask for, each way."""
MAX_BYTES = 1 << 30
_MAX_LINE = 4096
_PINGS = 20


class ProbeError(Exception):
    """A probe could not be made: the peer did not answer, refused the token, or the link broke."""


@dataclass(frozen=True)
class LinkSample:
    """One link measured from ``src``: bandwidth each way (Mbit/s) and the median round trip (ms)."""

    src: str
    dst: str
    out_mbps: float
    """src → dst."""
    in_mbps: float
    """dst → src."""
    rtt_ms: float
    seconds: float
    """How long the probe took, all three parts."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "LinkSample":
        return cls(src=str(data["src"]), dst=str(data["dst"]), out_mbps=float(data["out_mbps"]),
                   in_mbps=float(data["in_mbps"]), rtt_ms=float(data["rtt_ms"]), seconds=float(data["seconds"]))


# ---- framing -------------------------------------------------------------------------------------------------


def _send_line(sock: socket.socket, obj: dict) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


def _recv_line(sock: socket.socket) -> dict:
    buf = bytearray()
    while not buf.endswith(b"\n"):
        chunk = sock.recv(1)
        if not chunk:
            raise ConnectionError("closed before a whole line")
        buf += chunk
        if len(buf) > _MAX_LINE:
            raise ValueError("request line too long")
    data = json.loads(buf)
    if not isinstance(data, dict):
        raise ValueError("a request is a JSON object")
    return data


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    view = bytearray(n)
    got = 0
    while got < n:
        k = sock.recv_into(memoryview(view)[got:], n - got)
        if not k:
            raise ConnectionError("closed mid-frame")
        got += k
    return bytes(view)


def _drain(sock: socket.socket) -> int:
    """Read frames until the empty one; the bytes received."""
    total, buf = 0, bytearray(_CHUNK)
    while True:
        (n,) = _FRAME.unpack(_recv_exact(sock, 4))
        if n == 0:
            return total
        if n > _CHUNK:
            raise ValueError(f"frame of {n} bytes is larger than {_CHUNK}")
        got = 0
        while got < n:
            k = sock.recv_into(memoryview(buf)[:n - got], n - got)
            if not k:
                raise ConnectionError("closed mid-frame")
            got += k
        total += n


def _stream(sock: socket.socket, seconds: float, max_bytes: int) -> int:
    """Send frames for ``seconds`` or ``max_bytes``, then the empty one; the bytes sent."""
    frame = _FRAME.pack(_CHUNK) + _PAYLOAD
    deadline, sent = time.monotonic() + seconds, 0
    while sent < max_bytes and time.monotonic() < deadline:
        sock.sendall(frame)
        sent += _CHUNK
    sock.sendall(_FRAME.pack(0))
    return sent


def _bounded(value: Any, limit: float, default: float) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return default
    return max(0.0, min(number, limit))


# ---- the client side -------------------------------------------------------------------------------------------


def _connect(addr: str, port: int, timeout: float) -> socket.socket:
    try:
        sock = socket.create_connection((addr, port), timeout=timeout)
    except OSError as exc:
        raise ProbeError(f"cannot reach the link probe at {addr}:{port}: {exc}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _answer(sock: socket.socket) -> dict:
    reply = _recv_line(sock)
    if "error" in reply:
        raise ProbeError(str(reply["error"]))
    return reply


def measure_link(src: str, dst: str, addr: str, port: int, token: str, *, seconds: float = 0.5,
                 timeout: float = 30.0) -> LinkSample:
    """Measure the link from this process to the probe server of node ``dst`` at ``addr:port``."""
    t0 = time.monotonic()
    try:
        with _connect(addr, port, timeout) as sock:  # this side → dst: into its sink
            _send_line(sock, {"op": "sink", "token": token})
            _answer(sock)
            start = time.monotonic()
            _stream(sock, seconds, MAX_BYTES)
            received = int(_answer(sock)["bytes"])
            out_mbps = received * 8 / 1e6 / max(time.monotonic() - start, 1e-6)
        with _connect(addr, port, timeout) as sock:  # dst → this side: from its source
            _send_line(sock, {"op": "source", "token": token, "seconds": seconds})
            _answer(sock)
            start = time.monotonic()
            received = _drain(sock)
            in_mbps = received * 8 / 1e6 / max(time.monotonic() - start, 1e-6)
        with _connect(addr, port, timeout) as sock:  # round trips of one small message
            _send_line(sock, {"op": "echo", "token": token, "count": _PINGS})
            _answer(sock)
            rtts = []
            for _ in range(_PINGS):
                start = time.monotonic()
                sock.sendall(b"p" * 64)
                _recv_exact(sock, 64)
                rtts.append((time.monotonic() - start) * 1e3)
    except (OSError, ConnectionError, ValueError, KeyError) as exc:
        raise ProbeError(f"the probe of {dst} ({addr}:{port}) broke off: {type(exc).__name__}: {exc}") from None
    rtts.sort()
    return LinkSample(src=src, dst=dst, out_mbps=out_mbps, in_mbps=in_mbps, rtt_ms=rtts[len(rtts) // 2],
                      seconds=time.monotonic() - t0)


def request_probe(addr: str, port: int, token: str, *, peer: str, peer_addr: str, peer_port: int,
                  peer_token: str, seconds: float = 0.5, timeout: float = 60.0) -> LinkSample:
    """Ask the probe server at ``addr:port`` to measure its link to ``peer``; what it measured."""
    with _connect(addr, port, timeout) as sock:
        try:
            _send_line(sock, {"op": "probe", "token": token, "peer": peer, "peer_addr": peer_addr,
                              "peer_port": peer_port, "peer_token": peer_token, "seconds": seconds})
            return LinkSample.from_json(_answer(sock)["sample"])
        except (OSError, ConnectionError, ValueError, KeyError, TypeError) as exc:
            raise ProbeError(f"the probe server at {addr}:{port} did not answer: {type(exc).__name__}: "
                             f"{exc}") from None


# ---- the server ----------------------------------------------------------------------------------------------


class ProbeServer:
    """Sinks, sources and echoes for probes, and probes a peer when asked; one thread per connection, at
    most ``max_connections`` at once."""

    def __init__(self, node: str, host: str, port: int = 0, *, token: str | None = None,
                 max_connections: int = 8) -> None:
        self.node, self.token = node, token or secrets.token_hex(16)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as exc:
            self._listener.close()
            raise ProbeError(f"cannot listen for link probes on {host}:{port}: {exc}") from None
        self._listener.listen(16)
        self.host, self.port = host, self._listener.getsockname()[1]
        self._slots = threading.BoundedSemaphore(max_connections)
        self._stopping = False
        self._thread: threading.Thread | None = None

    def record(self) -> dict[str, Any]:
        """What the node's membership record carries so that a coordinator can use this server."""
        return {"port": self.port, "token": self.token}

    def start(self) -> "ProbeServer":
        self._thread = threading.Thread(target=self._serve, name="trainwarden-linkprobe", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        if self._thread is not None:
            self._thread.join(5)

    def _serve(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                conn.close()  # busy: the coordinator retries or reports it
                continue
            threading.Thread(target=self._handle, args=(conn,), name="trainwarden-linkprobe-conn",
                             daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(2 * MAX_SECONDS + 30)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    request = _recv_line(conn)
                except (OSError, ConnectionError, ValueError):
                    return
                if not secrets.compare_digest(str(request.get("token", "")), self.token):
                    _send_line(conn, {"error": f"node {self.node}: wrong or missing link-probe token (it is in the "
                                               f"node's record in etcd)"})
                    return
                self._dispatch(conn, request)
        except (OSError, ConnectionError, ValueError) as exc:
            log.debug("link probe connection ended: %s", exc)
        finally:
            self._slots.release()

    def _dispatch(self, conn: socket.socket, request: dict) -> None:
        op = request.get("op")
        if op == "sink":
            _send_line(conn, {"ok": True})
            _send_line(conn, {"bytes": _drain(conn)})
        elif op == "source":
            _send_line(conn, {"ok": True})
            _stream(conn, _bounded(request.get("seconds"), MAX_SECONDS, 0.5), MAX_BYTES)
        elif op == "echo":
            count = int(_bounded(request.get("count"), 1000, _PINGS))
            _send_line(conn, {"ok": True})
            for _ in range(count):
                conn.sendall(_recv_exact(conn, 64))
        elif op == "probe":
            try:
                sample = measure_link(self.node, str(request["peer"]), str(request["peer_addr"]),
                                      int(request["peer_port"]), str(request["peer_token"]),
                                      seconds=_bounded(request.get("seconds"), MAX_SECONDS, 0.5))
            except ProbeError as exc:
                _send_line(conn, {"error": f"node {self.node}: {exc}"})
                return
            except (KeyError, TypeError, ValueError) as exc:
                _send_line(conn, {"error": f"node {self.node}: malformed probe request ({exc})"})
                return
            _send_line(conn, {"sample": sample.to_json()})
        else:
            _send_line(conn, {"error": f"node {self.node}: unknown link-probe op {op!r}"})

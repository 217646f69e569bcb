"""The link probe: a small TCP server each node of a multi-node job runs on its job address, and the client
side that measures one link with it.

A coordinator (``trainwarden linkcheck``, or a node that saw a communication regression) asks node A's server
to *probe* node B: A streams bytes into B's sink for a bounded time (A→B bandwidth), pulls bytes from B's source
for as long (B→A), and times small round trips (latency). Because A and B are the job's own nodes and their
job addresses, the probe crosses the links the job's collectives cross, which the ranks' own numbers cannot
name: a collective is as slow as its slowest link, on every rank.

What one TCP stream achieves is a relative measure, not a NIC's line rate: the verdict (``verdict.py``)
compares the job's links with each other.

The wire format: a client sends one JSON line ``{"op": ..., "token": ...}`` and gets one back; then bulk bytes
flow one way for the request's ``seconds``, counted by the receiver from its first byte, so a badly degraded
link costs the same seconds to measure as a healthy one (not the drain of a socket buffer). The
server answers only requests that carry its token (a random secret it publishes in its node record in etcd,
readable by whoever may read the job), probes only peers the caller names with their own token, and caps
every transfer: a stray connection can neither drive traffic nor hold the server.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["LinkSample", "ProbeError", "ProbeServer", "measure_link", "request_probe"]

log = logging.getLogger(__name__)

_CHUNK = 256 * 1024
_PAYLOAD = os.urandom(_CHUNK)  # incompressible, made once
MAX_SECONDS = 5.0
"""The longest transfer one request may ask for, each way."""
WINDOW_BYTES = 64 << 20
"""The most one window sends: a probe moves at most 4 windows (two each way), 256 MiB, on the fastest link."""
_MAX_LINE = 4096
_PINGS = 20
_WINDOWS = 2
"""Windows per direction; ``seconds`` is shared between them."""


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
            raise ConnectionError("closed mid-message")
        got += k
    return bytes(view)


def _receive_window(sock: socket.socket, seconds: float) -> tuple[int, float]:
    """Count what arrives for ``seconds`` from its first byte (or until the sender ends or hangs up): the
    bytes and the seconds they took. Bounded by time, not by what is in flight: a link at a thousandth of its
    speed costs the same seconds to measure, not the drain of a socket buffer."""
    buf = bytearray(_CHUNK)
    total, first = 0, None
    sock.settimeout(MAX_SECONDS + 30)  # the first byte: a working link brings it long before
    while True:
        try:
            k = sock.recv_into(buf)
        except socket.timeout:
            break
        now = time.monotonic()
        if not k:
            break
        if first is None:
            first = now
        total += k
        if now - first >= seconds:
            break
        sock.settimeout(max(0.005, seconds - (now - first)))
    # from the first byte to the window's end (a timeout) or the sender's: a trickle that stopped early
    # still counts over the time it was given
    return total, (time.monotonic() - first) if first is not None else 0.0


def _send_window(sock: socket.socket, seconds: float) -> None:
    """Send for ``seconds`` or ``WINDOW_BYTES`` (never blocked past them by a full buffer; ended early if the
    receiver answers or hangs up), then end the stream."""
    deadline, sent = time.monotonic() + seconds, 0
    sock.setblocking(False)
    try:
        while (left := deadline - time.monotonic()) > 0 and sent < WINDOW_BYTES:
            readable, writable, _ = select.select([sock], [sock], [], min(0.05, left))
            if readable:  # the receiver answered (its window is over) or hung up
                break
            if writable:
                try:
                    sent += sock.send(_PAYLOAD)
                except BlockingIOError:
                    pass
    except OSError:  # the receiver hung up: its count is what matters
        return
    finally:
        sock.setblocking(True)
        sock.settimeout(MAX_SECONDS + 30)
    try:
        sock.shutdown(socket.SHUT_WR)  # the receiver sees the end at once, past whatever is still in flight
    except OSError:
        pass


def _discard_until_closed(sock: socket.socket, limit_s: float = MAX_SECONDS + 5) -> None:
    """Read and drop what the peer still sends, until it ends (closing with unread bytes would reset the
    connection, and could lose the answer just sent)."""
    deadline = time.monotonic() + limit_s
    buf = bytearray(_CHUNK)
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv_into(buf):
                return
    except OSError:
        return


def _abort(sock: socket.socket) -> None:
    """Close at once, dropping what is still queued to send: on a slow link a graceful close would go on
    sending a socket buffer's worth for seconds, in the way of the job's own traffic."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def _rate(nbytes: int, seconds: float) -> float:
    """Mbit/s of ``nbytes`` over ``seconds`` (a single arrival: counted over a millisecond)."""
    return nbytes * 8 / 1e6 / max(seconds, 1e-3)


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
        out_mbps = in_mbps = 0.0
        for _ in range(_WINDOWS):  # the best of a few windows: a busy CPU only ever makes a link look slower
            with _connect(addr, port, timeout) as sock:  # this side → dst: into its sink, which counts
                _send_line(sock, {"op": "sink", "token": token, "seconds": seconds / _WINDOWS})
                _answer(sock)
                _send_window(sock, seconds / _WINDOWS)
                counted = _answer(sock)
                _abort(sock)
                out_mbps = max(out_mbps, _rate(int(counted["bytes"]), float(counted["seconds"])))
            with _connect(addr, port, timeout) as sock:  # dst → this side: from its source, counted here
                _send_line(sock, {"op": "source", "token": token, "seconds": seconds / _WINDOWS})
                _answer(sock)
                in_mbps = max(in_mbps, _rate(*_receive_window(sock, seconds / _WINDOWS)))
                _abort(sock)
        with _connect(addr, port, timeout) as sock:  # round trips of one small message, for up to a second
            _send_line(sock, {"op": "echo", "token": token, "count": _PINGS})
            _answer(sock)
            rtts: list[float] = []
            stop = time.monotonic() + 1.0
            while len(rtts) < _PINGS and (not rtts or time.monotonic() < stop):
                start = time.monotonic()
                sock.sendall(b"p" * 64)
                _recv_exact(sock, 64)
                rtts.append((time.monotonic() - start) * 1e3)
            sock.shutdown(socket.SHUT_WR)
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
        seconds = _bounded(request.get("seconds"), MAX_SECONDS, 0.5)
        if op == "sink":
            _send_line(conn, {"ok": True})
            nbytes, took = _receive_window(conn, seconds)
            conn.settimeout(MAX_SECONDS + 30)
            _send_line(conn, {"bytes": nbytes, "seconds": took})
            _discard_until_closed(conn)
        elif op == "source":
            _send_line(conn, {"ok": True})
            _send_window(conn, seconds)
            _discard_until_closed(conn)  # the prober's count is done when it hangs up
            _abort(conn)
        elif op == "echo":
            count = int(_bounded(request.get("count"), 1000, _PINGS))
            _send_line(conn, {"ok": True})
            for _ in range(count):
                try:
                    message = _recv_exact(conn, 64)
                except ConnectionError:  # the prober stopped early (its second was up)
                    return
                conn.sendall(message)
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

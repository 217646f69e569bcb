"""An HTTP server whose threads are bounded, whoever connects: the metrics endpoint and the Alertmanager webhook.

Design
------
``http.server.ThreadingHTTPServer`` starts a thread per connection and keeps it until the client closes: 200 idle
TCP connections are 200 threads of the root daemon. ``BoundedHTTPServer`` instead

- lets an accepted connection wait for its first byte in one selector thread (no thread of its own), and closes it
  when ``idle_timeout_s`` passes without one; at most ``max_waiting`` wait, and a new connection beyond that
  closes the oldest waiting one (an idle flood costs its own connections, never a new scrape's);
- serves a connection that has something to say on a pool of ``max_threads`` threads, its socket under
  ``request_timeout_s`` per read and write, so a client that stalls mid-request holds one pool thread that long.

So the server holds ``max_threads + 2`` threads at most (pool, selector, accept loop). Not covered: clients that
each send part of a request and stall hold a pool thread each for ``request_timeout_s``; a flood of those delays
other requests by that much per ``max_threads`` of them.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import HTTPServer

__all__ = ["BoundedHTTPServer"]

logger = logging.getLogger(__name__)


class BoundedHTTPServer(HTTPServer):
    """``HTTPServer`` with a bounded pool and idle/request timeouts (module docstring). ``serve_forever`` as usual;
    ``server_close`` also ends the pool and the selector thread."""

    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address, handler, *, max_threads: int = 8, idle_timeout_s: float = 5.0,
                 request_timeout_s: float = 5.0, max_waiting: int = 256, name: str = "http") -> None:
        self.check_limits(max_threads=max_threads, idle_timeout_s=idle_timeout_s, request_timeout_s=request_timeout_s,
                          max_waiting=max_waiting)
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.max_threads, self.idle_timeout_s, self.request_timeout_s = max_threads, idle_timeout_s, request_timeout_s
        self._max_waiting = max_waiting
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix=f"{name}-request")
        self._selector = selectors.DefaultSelector()
        self._waiting: dict[socket.socket, tuple[object, float]] = {}  # insertion order: oldest first
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._closing = threading.Event()
        self._waiter = threading.Thread(target=self._wait_loop, name=f"{name}-idle", daemon=True)
        self._waiter.start()
        super().__init__(address, handler)  # a bind that fails calls server_close: everything above ends

    @staticmethod
    def check_limits(*, max_threads: int = 8, idle_timeout_s: float = 5.0, request_timeout_s: float = 5.0,
                     max_waiting: int = 256) -> None:
        """``ValueError`` naming the limit that is out of range."""
        for what, value, least in (("max_threads", max_threads, 1), ("max_waiting", max_waiting, 1),
                                   ("idle_timeout_s", idle_timeout_s, 0.01),
                                   ("request_timeout_s", request_timeout_s, 0.01)):
            if not (isinstance(value, (int, float)) and value >= least):
                raise ValueError(f"{what} must be at least {least}, got {value!r}")

    # socketserver calls this on the accept loop for each new connection
    def process_request(self, request, client_address) -> None:
        evicted = None
        with self._lock:
            if self._closing.is_set():
                evicted = request
            else:
                if len(self._waiting) >= self._max_waiting:
                    evicted = next(iter(self._waiting))
                    self._forget(evicted)
                self._waiting[request] = (client_address, time.monotonic() + self.idle_timeout_s)
                self._selector.register(request, selectors.EVENT_READ)
        if evicted is not None:
            self.shutdown_request(evicted)
        self._wake()

    def _forget(self, request) -> None:
        del self._waiting[request]
        self._selector.unregister(request)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (the waiter is behind) or closed: it looks again anyway
            pass

    def _wait_loop(self) -> None:
        while not self._closing.is_set():
            try:
                with self._lock:
                    first = min((deadline for _, deadline in self._waiting.values()), default=None)
                wait = 1.0 if first is None else max(0.0, min(1.0, first - time.monotonic()))
                ready, expired = [], []
                for key, _ in self._selector.select(wait):
                    if key.fileobj is self._wake_r:
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except OSError:
                            pass
                    else:
                        ready.append(key.fileobj)
                now = time.monotonic()
                with self._lock:
                    for request in ready:
                        if request in self._waiting:
                            address, _ = self._waiting[request]
                            self._forget(request)
                            self._pool.submit(self._serve, request, address)
                    for request, (_, deadline) in list(self._waiting.items()):
                        if deadline <= now:
                            self._forget(request)
                            expired.append(request)
                for request in expired:  # said nothing within idle_timeout_s
                    self.shutdown_request(request)
            except Exception:  # one bad iteration must not end the server's selector
                if not self._closing.is_set():
                    logger.exception("%s: the idle-connection loop failed; going on", self._waiter.name)
                    time.sleep(0.1)

    def _serve(self, request, client_address) -> None:
        try:
            request.settimeout(self.request_timeout_s)
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)

    def server_close(self) -> None:
        super().server_close()
        self._closing.set()
        self._wake()
        self._waiter.join(5.0)
        with self._lock:
            waiting = list(self._waiting)
            self._waiting.clear()
        for request in waiting:
            self.shutdown_request(request)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

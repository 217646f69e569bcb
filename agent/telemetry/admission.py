"""How many telemetry streams the agent holds, and for whom: its limits for anyone who can reach the socket.

Design
------
Each open stream holds a thread of the telemetry server's pool (gRPC's sync server), and anyone in the socket's
group can open streams. So (docs/SECURITY.md, "Streams a local user can hold"):

- ``StreamAdmission`` admits a stream only while fewer than ``max_streams`` are open in all and fewer than
  ``max_per_uid`` are open for its uid. The uid is the kernel's: a worker's stream carries its peer token in the
  call's metadata (``PEER_TOKEN_METADATA``), so the agent knows who it is before any message; a stream without one
  (an older runtime, or anyone) counts under "unidentified", which has the same cap. A stream beyond a cap is
  refused at once (RESOURCE_EXHAUSTED, saying which cap and how to raise it); it holds no thread.
- ``HelloDeadlines``: a stream whose Hello has not arrived ``hello_timeout_s`` after it opened is cancelled, by one
  thread for all streams, so an idle stream frees its thread within that bound.

Because streams never hold more than ``max_streams`` of the pool, the server keeps threads for the unary calls
(the health check that ``trainwarden agent --check`` and the keep-alives ask, ``Status``, ``Commit``) however
many streams are open or being refused.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Hashable

__all__ = ["HelloDeadlines", "StreamAdmission", "UNIDENTIFIED"]

log = logging.getLogger(__name__)

UNIDENTIFIED = "unidentified"
"""The bucket of streams whose uid the agent does not know before their Hello (no peer token in the metadata)."""


class StreamAdmission:
    """Counts open streams in all and per uid; ``admit`` says why a new one may not open (module docstring)."""

    def __init__(self, *, max_streams: int, max_per_uid: int) -> None:
        if max_per_uid < 1:
            raise ValueError(f"max_streams_per_uid must be at least 1, got {max_per_uid}")
        self.max_streams, self.max_per_uid = max_streams, max_per_uid
        self._open: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def admit(self, who: int | str) -> str | None:
        """Count a new stream of ``who`` (a uid, or ``UNIDENTIFIED``) and return None, or why it is refused."""
        with self._lock:
            total, mine = sum(self._open.values()), self._open.get(who, 0)
            if total >= self.max_streams:
                return (f"the agent holds {total} telemetry streams, its limit (max_streams); streams are refused "
                        "until some end")
            if mine >= self.max_per_uid:
                whom = f"uid {who}" if who != UNIDENTIFIED else "streams without a peer token in their metadata"
                return (f"{whom} already holds {mine} telemetry streams, the limit per uid (max_streams_per_uid); "
                        "end some, or raise telemetry_max_streams_per_uid in the agent's config")
            self._open[who] = mine + 1
            return None

    def move(self, who: int | str, to: int | str) -> str | None:
        """A stream of ``who`` turned out to be ``to``'s (its Hello's token): recount it, or say why ``to`` may
        not hold another (the stream then stays counted under ``who`` until ``release``)."""
        if who == to:
            return None
        with self._lock:
            if self._open.get(to, 0) >= self.max_per_uid:
                return (f"uid {to} already holds {self._open[to]} telemetry streams, the limit per uid "
                        "(max_streams_per_uid)")
            self._release(who)
            self._open[to] = self._open.get(to, 0) + 1
            return None

    def release(self, who: int | str) -> None:
        with self._lock:
            self._release(who)

    def _release(self, who) -> None:
        left = self._open.get(who, 0) - 1
        if left > 0:
            self._open[who] = left
        else:
            self._open.pop(who, None)

    def open_streams(self) -> dict:
        """uid (or ``UNIDENTIFIED``) -> streams open now."""
        with self._lock:
            return dict(self._open)


class HelloDeadlines:
    """Calls a stream's ``cancel`` when its Hello has not come ``timeout_s`` after ``expect``; one thread for all."""

    def __init__(self, timeout_s: float, *, clock: Callable[[], float] = time.monotonic,
                 on_expired: Callable[[], None] | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"hello_timeout_s must be positive, got {timeout_s}")
        self.timeout_s, self._clock, self._on_expired = timeout_s, clock, on_expired
        self._pending: dict[object, tuple[float, Callable[[], None]]] = {}  # insertion order: earliest first
        self._changed = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="telemetry-hello-deadline", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._changed:
            self._stop = True
            self._changed.notify()
        if self._thread is not None:
            self._thread.join(2.0)

    def expect(self, key: object, cancel: Callable[[], None]) -> None:
        with self._changed:
            self._pending[key] = (self._clock() + self.timeout_s, cancel)
            self._changed.notify()

    def arrived(self, key: object) -> None:
        with self._changed:
            self._pending.pop(key, None)

    def _run(self) -> None:
        while True:
            with self._changed:
                if self._stop:
                    return
                now = self._clock()
                expired = [key for key, (deadline, _) in self._pending.items() if deadline <= now]
                cancels = [self._pending.pop(key)[1] for key in expired]
                if not cancels:
                    first = min((d for d, _ in self._pending.values()), default=now + 1.0)
                    self._changed.wait(max(0.01, min(1.0, first - now)))
                    continue
            for cancel in cancels:
                try:
                    cancel()
                    if self._on_expired is not None:
                        self._on_expired()
                except Exception:  # one stream that cannot be cancelled must not end the loop
                    log.exception("cannot cancel a telemetry stream that sent no Hello")
            log.info("%d telemetry stream(s) sent no Hello within %g s; closed", len(cancels), self.timeout_s)

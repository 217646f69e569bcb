"""A watch on one etcd key or prefix that says when it is gone, so a poll can become a watch.

python3-etcd3 multiplexes every watch of a client on one gRPC stream. When that stream breaks (etcd restarted,
the member went away, a network cut) its reader thread drops every callback and means to tell each of them,
but fails first (``six`` is not imported in ``etcd3/watch.py``): the callbacks never hear of it, and the watch
is silently dead. ``KeyWatch.alive()`` asks the client whether this watch's callback is still registered
(``watch_registered``: the one place that reads the library's private ``watcher._callbacks``; where the layout
differs it answers True and only the caller's slow safety re-read catches a lost watch). A caller therefore:

* reads the state it watches once, then ``start()`` s the watch (events after the read's revision are never
  missed: the watch starts at ``revision + 1``);
* checks ``alive()`` on a local timer (no etcd request) and, when it is False or an error was reported, reads
  again and starts a new watch;
* re-reads everything on a slow timer anyway (a safety net for what no check sees).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

logger = logging.getLogger(__name__)

__all__ = ["KeyWatch", "watch_registered"]


def watch_registered(client, watch_id, callback) -> bool:
    """Whether python3-etcd3 still delivers watch ``watch_id`` to ``callback`` (False once its stream broke: the
    library then drops every callback without a word). The one reader of its private ``watcher._callbacks``; where
    that layout differs it answers True, and only a caller's slow re-read catches a lost watch."""
    if watch_id is None:
        return False
    try:
        watcher = getattr(client, "watcher", None)
    except Exception:  # noqa: BLE001 - its stubs were dropped and no endpoint can make a new one: nothing delivers
        return False
    callbacks = getattr(watcher, "_callbacks", None)
    if not isinstance(callbacks, dict):
        return True
    return callbacks.get(watch_id) == callback


class KeyWatch:
    """``on_events(events)`` for every change of ``key`` (or of every key under it with ``prefix``), from the
    client's watch thread: keep it short and never call etcd from it. ``on_error(exc)`` when etcd reports the
    watch broken (a compaction past its start revision, a cancel); ``alive()`` is then False."""

    def __init__(self, client, key: str, on_events: Callable[[list], None], *, prefix: bool = False,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self._client, self.key, self._prefix = client, key, prefix
        self._on_events, self._on_error = on_events, on_error
        self._id = None
        self._failed = False
        self._lock = threading.Lock()

    def start(self, start_revision: int | None = None) -> None:
        """Create the watch (an etcd request: raises when etcd does not answer)."""
        add = self._client.add_watch_prefix_callback if self._prefix else self._client.add_watch_callback
        kwargs = {} if start_revision is None else {"start_revision": int(start_revision)}
        with self._lock:
            self._failed = False
        watch_id = add(self.key, self._callback, **kwargs)
        with self._lock:
            self._id = watch_id

    def alive(self) -> bool:
        """False once the watch broke or was never made; True while the client still delivers its events."""
        with self._lock:
            if self._id is None or self._failed:
                return False
            watch_id = self._id
        return watch_registered(self._client, watch_id, self._callback)

    def stop(self) -> None:
        """Cancel the watch (best effort: a dead stream has nothing to cancel)."""
        with self._lock:
            watch_id, self._id = self._id, None
        if watch_id is None:
            return
        try:
            self._client.cancel_watch(watch_id)
        except Exception as exc:
            logger.debug("cancelling the watch of %s: %s", self.key, exc)

    def _callback(self, response) -> None:
        events = getattr(response, "events", None)
        if events is None:  # an exception (etcd3 hands errors to the callback), or None for a closed stream
            with self._lock:
                self._failed = True
            if self._on_error is not None:
                self._on_error(response if isinstance(response, BaseException) else RuntimeError("watch closed"))
            return
        if events:
            self._on_events(list(events))

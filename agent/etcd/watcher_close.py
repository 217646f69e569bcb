"""A closed python3-etcd3 watcher ends its thread: its stream is cancelled, not only half-closed.

python3-etcd3 (0.13) gives each client one ``Watcher`` per endpoint in use: a thread reading one gRPC Watch stream.
When the client fails over to another member it closes the old watcher by ending the stream's request side, but
etcd keeps a half-closed watch stream open, so the old thread waits on it until the member goes away or the process
ends. In the hour's soak (issue 45) every ``trainwarden run`` gained 4-6 such threads (and their sockets) at its
first loss of etcd's quorum, each client having failed over through several members; on the bed, one run went from
1 watcher thread to 5.

``install()`` (called by ``open_etcd``, idempotent) keeps each watcher's gRPC call, and its ``close`` cancels it as
well: the reader thread then ends the way it does when a member dies (the library tells no callback of either;
``agent/etcd/watch.py`` is how callers notice). Where the library's layout differs it changes nothing.

The library's reader means to tell each callback when its stream ends, but ``etcd3/watch.py`` calls ``six``, which it
never imports: the thread dies of a ``NameError`` and its traceback lands in every agent's and launcher's log at each
etcd restart or failover, alarming and meaningless. ``install()`` gives that module a ``six`` whose ``itervalues``
yields nothing: the thread ends quietly, and the callbacks hear nothing, as before (every caller is built on that:
``KeyWatch.alive()``, the rendezvous' re-reads; telling them would turn an etcd blip into failed rounds).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

__all__ = ["install"]

_MARK = "_trainwarden_cancels_on_close"


class _KeptCalls:
    """Wraps a watcher's stub: each ``Watch`` call is kept on the watcher, for ``close`` to cancel."""

    def __init__(self, stub, watcher) -> None:
        self._stub, self._watcher = stub, watcher

    def Watch(self, *args, **kwargs):  # noqa: N802 - gRPC's name
        call = self._stub.Watch(*args, **kwargs)
        self._watcher._trainwarden_call = call
        return call

    def __getattr__(self, name):
        return getattr(self._stub, name)


class _QuietEnd:
    """What ``etcd3/watch.py`` asks of ``six`` when a stream ends: the callbacks to tell, here none (module docstring)."""

    @staticmethod
    def itervalues(_callbacks):
        return iter(())


def install() -> bool:
    """Make closed watchers cancel their stream, and an ended stream's reader end without a traceback; False when
    the library's layout is not the one known."""
    try:
        from etcd3 import watch
    except ImportError:
        return False
    if not hasattr(watch, "six"):
        watch.six = _QuietEnd
    watcher = getattr(watch, "Watcher", None)
    if watcher is None or getattr(watcher, _MARK, False):
        return watcher is not None
    init, close = getattr(watcher, "__init__", None), getattr(watcher, "close", None)
    if init is None or close is None:
        return False

    def __init__(self, watchstub, *args, **kwargs):  # noqa: N807
        init(self, _KeptCalls(watchstub, self), *args, **kwargs)

    def cancelling_close(self):
        close(self)
        call = getattr(self, "_trainwarden_call", None)
        if call is not None:
            try:
                call.cancel()
            except Exception as exc:  # noqa: BLE001 - a call already ended, or one of another kind
                logger.debug("cancelling a closed etcd watcher's stream: %s", exc)

    watcher.__init__, watcher.close = __init__, cancelling_close
    setattr(watcher, _MARK, True)
    return True

"""A closed python3-etcd3 watcher ends its thread (agent/etcd/watcher_close.py): etcd keeps a half-closed watch
stream open, so without the cancel a failed-over client's old watcher thread waited on it for good (4-6 threads a
`trainwarden run` after its first loss of etcd's quorum in the hour's soak)."""

from __future__ import annotations

import threading

import grpc
import pytest
from etcd3 import watch

from trainwarden.agent.etcd import watcher_close

pytestmark = pytest.mark.timeout(30)


class _Stream(grpc.RpcError):
    """A Watch call as etcd answers a half-closed stream: nothing more arrives until it is cancelled."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def __iter__(self):
        return self

    def __next__(self):
        self.cancelled.wait()
        raise self

    def cancel(self) -> bool:
        self.cancelled.set()
        return True


class _Stub:
    def __init__(self) -> None:
        self.calls: list[_Stream] = []

    def Watch(self, requests, **kwargs):  # noqa: N802 - gRPC's name
        self.calls.append(_Stream())
        return self.calls[-1]


def _reader(watcher) -> threading.Thread:
    """The watcher's reader thread, as ``add_callback`` starts it (without a watch request to answer)."""
    thread = watcher._callback_thread = threading.Thread(target=watcher._run, name="etcd3_watch_test", daemon=True)
    thread.start()
    return thread


def test_a_closed_watcher_cancels_its_stream_and_its_thread_ends():
    assert watcher_close.install() and watcher_close.install()  # idempotent
    stub = _Stub()
    watcher = watch.Watcher(stub, timeout=1)
    thread = _reader(watcher)
    for _ in range(100):
        if stub.calls:
            break
        thread.join(0.01)
    assert stub.calls and thread.is_alive()
    watcher.close()
    thread.join(5)
    assert not thread.is_alive() and stub.calls[0].cancelled.is_set()


def test_a_watcher_that_never_opened_a_stream_closes_quietly():
    watcher_close.install()
    watch.Watcher(_Stub(), timeout=1).close()


def test_a_stream_that_breaks_ends_its_reader_without_a_traceback_and_tells_no_callback(monkeypatch):
    """The library's reader calls ``six``, which ``etcd3/watch.py`` never imports: before ``install()`` gave it
    one, each broken stream left a ``NameError`` traceback in the agent's log (CI's warnings; every launcher's log at
    an etcd restart). The callbacks still hear nothing: the callers notice through ``alive()`` and re-reads."""
    uncaught = []
    monkeypatch.setattr(threading, "excepthook", uncaught.append)
    watcher_close.install()
    stub = _Stub()
    watcher = watch.Watcher(stub, timeout=1)
    told = []
    watcher._callbacks[7] = told.append
    thread = _reader(watcher)
    for _ in range(100):
        if stub.calls:
            break
        thread.join(0.01)
    stub.calls[0].cancel()  # the stream fails as a dead member's does
    thread.join(5)
    assert not thread.is_alive()
    assert uncaught == [] and told == [] and watcher._callbacks == {}

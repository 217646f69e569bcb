"""``watch_registered`` (agent/etcd/watch.py): whether python3-etcd3 still delivers a watch, read without etcd."""

import etcd3.exceptions
import pytest

from trainwarden.agent.etcd.watch import watch_registered

pytestmark = pytest.mark.timeout(10)


def on_events(response):
    pass


class Watcher:
    def __init__(self, callbacks):
        self._callbacks = callbacks


class Client:
    def __init__(self, watcher=None, error=None):
        self._watcher, self._error = watcher, error

    @property
    def watcher(self):  # python3-etcd3 makes a new watcher here when its stubs were dropped, which needs a channel
        if self._error is not None:
            raise self._error
        return self._watcher


def test_a_registered_callback_is_alive_and_a_dropped_one_is_not():
    assert watch_registered(Client(Watcher({7: on_events})), 7, on_events)
    assert not watch_registered(Client(Watcher({})), 7, on_events)  # the stream broke: every callback dropped
    assert not watch_registered(Client(Watcher({7: print})), 7, on_events)
    assert not watch_registered(Client(Watcher({})), None, on_events)


def test_a_client_that_cannot_make_a_watcher_has_no_live_watch_and_does_not_raise():
    # a failover client whose every endpoint failed dropped its stubs; reading `watcher` raised
    # NoServerAvailableError out of the rendezvous handler's num_nodes_waiting, which ended torchrun's agent
    # during a 3-member etcd's loss of quorum (tests/integration/test_multinode.py)
    error = etcd3.exceptions.NoServerAvailableError("No endpoint available and not failed")
    assert not watch_registered(Client(error=error), 7, on_events)


def test_a_client_of_another_layout_is_trusted():
    assert watch_registered(object(), 7, on_events)  # no watcher attribute: only the caller's re-read checks

"""A restart's ``next_rendezvous`` waits out an etcd that does not answer, up to the join timeout, and raises
everything else at once (agent/rendezvous/native_handler.py; the real etcd's loss of quorum is
tests/integration/test_etcd_cluster_run.py)."""

from __future__ import annotations

import etcd3
import grpc
import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from trainwarden.agent.rendezvous import native_handler
from trainwarden.agent.rendezvous.native import NativeRendezvousConfig, NativeRendezvousError, NativeRendezvousUnavailable
from trainwarden.agent.rendezvous.native_handler import NativeRendezvousHandler

pytestmark = pytest.mark.timeout(30)


class _Denied(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAUTHENTICATED

    def details(self):
        return "etcdserver: authentication failed, invalid user ID or password"


def _connection_error(cause: BaseException) -> RendezvousConnectionError:
    try:
        raise RendezvousConnectionError(str(cause)) from cause
    except RendezvousConnectionError as exc:
        return exc


def _handler(monkeypatch, outcomes, join_timeout_s=600.0):
    """A handler whose one attempt at the round gives ``outcomes`` in turn (an exception is raised)."""
    clock = [0.0]
    monkeypatch.setattr(native_handler.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(native_handler.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    handler = NativeRendezvousHandler.__new__(NativeRendezvousHandler)
    handler.node, handler._config = "n0_1_0", NativeRendezvousConfig(min_nodes=1, max_nodes=1,
                                                                      join_timeout_s=join_timeout_s)
    tries = iter(outcomes)

    def once():
        clock[0] += 0.5
        outcome = next(tries)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    handler._next_rendezvous_once = once
    return handler


def test_a_restart_waits_while_etcd_does_not_answer_and_joins_once_it_does(monkeypatch, caplog):
    away = [_connection_error(NativeRendezvousUnavailable("etcd did not answer")),
            _connection_error(etcd3.exceptions.ConnectionTimeoutError("etcd connection timeout")),
            _connection_error(etcd3.exceptions.NoServerAvailableError("No endpoint available"))]
    handler = _handler(monkeypatch, [*away, "the round"])
    assert handler.next_rendezvous() == "the round"
    text = caplog.text
    assert "the restart waits for etcd" in text and "etcd answered again after" in text


@pytest.mark.parametrize("cause", [_Denied(), NativeRendezvousError("its etcd lease has ended")],
                         ids=["credentials refused", "lease gone"])
def test_an_error_that_waiting_cannot_cure_is_raised_at_once(monkeypatch, cause):
    handler = _handler(monkeypatch, [_connection_error(cause), "never reached"])
    with pytest.raises(RendezvousConnectionError) as raised:
        handler.next_rendezvous()
    assert raised.value.__cause__ is cause


def test_an_etcd_away_longer_than_the_join_timeout_ends_the_wait_with_its_error(monkeypatch):
    away = _connection_error(NativeRendezvousUnavailable("etcd did not answer; check that etcd is running"))
    handler = _handler(monkeypatch, [away] * 100, join_timeout_s=10.0)
    with pytest.raises(RendezvousConnectionError, match="check that etcd is running"):
        handler.next_rendezvous()

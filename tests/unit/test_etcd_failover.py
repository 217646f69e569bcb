"""with_failover: a call that failed to connect is tried once on each other member; nothing else is retried."""

import etcd3
import pytest

from trainwarden.agent.etcd.client import with_failover


class Client:
    def __init__(self, members):
        self.endpoints = {f"m{i}:2379": object() for i in range(members)}


def flaky(failures, error=etcd3.exceptions.ConnectionFailedError):
    calls = []

    def op():
        calls.append(1)
        if len(calls) <= failures:
            raise error()
        return "ok"
    return op, calls


def test_a_refused_connection_moves_to_the_next_member():
    op, calls = flaky(2)
    assert with_failover(Client(3), op) == "ok" and len(calls) == 3


def test_when_every_member_refused_the_error_is_raised():
    op, calls = flaky(5)
    with pytest.raises(etcd3.exceptions.ConnectionFailedError):
        with_failover(Client(3), op)
    assert len(calls) == 3


def test_one_member_or_a_timeout_is_not_retried():
    op, calls = flaky(1)
    with pytest.raises(etcd3.exceptions.ConnectionFailedError):
        with_failover(Client(1), op)
    op, calls = flaky(1, etcd3.exceptions.ConnectionTimeoutError)  # may have been applied: never twice
    with pytest.raises(etcd3.exceptions.ConnectionTimeoutError):
        with_failover(Client(3), op)
    assert len(calls) == 1

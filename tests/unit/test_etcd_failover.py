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


def test_every_member_marked_failed_is_tried_again_once_after_the_marks_lapse():
    """Issue 45, the hour's soak: an etcd member killed, the other two briefly unavailable while they elected a
    leader, all three marked failed: the commit check's call raised NoServerAvailableError and the save was refused.
    Nothing was sent, so it is tried again once the marks lapse (FAILOVER_RETRY_S); a second one is raised."""
    slept = []
    op, calls = flaky(1, etcd3.exceptions.NoServerAvailableError)
    assert with_failover(Client(3), op, sleep=slept.append) == "ok" and len(calls) == 2 and slept == [2.0]
    op, calls = flaky(2, etcd3.exceptions.NoServerAvailableError)
    with pytest.raises(etcd3.exceptions.NoServerAvailableError):
        with_failover(Client(3), op, sleep=slept.append)
    assert len(calls) == 2

"""The sd_notify client against a unix datagram socket the test listens on, as systemd's would."""

from __future__ import annotations

import logging
import os
import socket
import uuid

import pytest

from trainwarden.agent.common.sdnotify import SdNotifier, watchdog_interval

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def listener(tmp_path):
    """A socket bound where NOTIFY_SOCKET will point, as systemd binds /run/systemd/notify."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(5)
    yield sock
    sock.close()


def lines(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def test_without_notify_socket_every_call_is_a_no_op():
    notifier = SdNotifier.from_environment({})
    assert not notifier.enabled and notifier.watchdog_s is None
    assert not notifier.ready("up") and not notifier.watchdog() and not notifier.stopping()


def test_notifications_arrive_one_datagram_each_with_key_value_lines(listener, tmp_path):
    notifier = SdNotifier.from_environment({"NOTIFY_SOCKET": str(tmp_path / "notify")})
    assert notifier.ready("serving on\nunix:/x")
    assert lines(listener) == ["READY=1", "STATUS=serving on unix:/x"]  # a newline would start a bogus key
    assert notifier.watchdog()
    assert lines(listener) == ["WATCHDOG=1"]
    assert notifier.status("busy")
    assert lines(listener) == ["STATUS=busy"]
    assert notifier.stopping("stopping: SIGTERM")
    assert lines(listener) == ["STOPPING=1", "STATUS=stopping: SIGTERM"]
    notifier.close()


def test_with_a_watchdog_ready_is_also_the_first_keep_alive(listener, tmp_path):
    notifier = SdNotifier.from_environment({"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "30000000"})
    assert notifier.watchdog_s == 30.0
    notifier.ready()
    assert lines(listener) == ["READY=1", "WATCHDOG=1"]


def test_an_abstract_socket_name_is_written_with_an_at_sign():
    name = f"trainwarden-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        assert SdNotifier.from_environment({"NOTIFY_SOCKET": "@" + name}).watchdog()
        assert lines(sock) == ["WATCHDOG=1"]


@pytest.mark.parametrize("environ, interval", [
    ({}, None),
    ({"WATCHDOG_USEC": "30000000"}, 30.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4242"}, 30.0),  # ours: pid 4242 below
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4243"}, None),  # inherited from another process
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "me"}, None),
])
def test_watchdog_interval_is_for_the_process_systemd_named(environ, interval):
    assert watchdog_interval(environ, pid=4242) == interval


def test_the_variables_are_taken_out_of_the_environment_the_jobs_inherit(tmp_path):
    environ = {"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid()),
               "PATH": "/bin"}
    notifier = SdNotifier.from_environment(environ, unset=True)
    assert notifier.enabled and notifier.watchdog_s == 2.0
    assert environ == {"PATH": "/bin"}


def test_a_failing_send_is_logged_once_and_never_raised(tmp_path, caplog):
    path = tmp_path / "notify"  # nothing listens yet: systemd restarting, say
    notifier = SdNotifier(str(path))
    with caplog.at_level(logging.INFO, logger="trainwarden.agent.common.sdnotify"):
        assert [notifier.watchdog() for _ in range(3)] == [False] * 3
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(str(path))
            assert notifier.watchdog()
            assert sock.recv(64) == b"WATCHDOG=1"
    assert "works again" in caplog.text


def test_an_address_it_cannot_use_turns_notifications_off(caplog):
    notifier = SdNotifier("vsock:2:1234")
    assert not notifier.enabled and not notifier.ready()
    assert "only a path or an @abstract name" in caplog.text

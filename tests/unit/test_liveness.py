"""Liveness: heartbeats of the agent's loops, and the daemon's readiness and keep-alives to systemd.

The keep-alives go through the real sd_notify client to a socket the test listens on; a wedged part is a real
thread stuck inside its iteration, with the heartbeats' clock faked so that minutes pass without waiting.
"""

from __future__ import annotations

import logging
import socket
import threading

import pytest

from procs import wait_for
from trainwarden.agent.common.heartbeat import Heartbeat
from trainwarden.agent.common.sdnotify import SdNotifier
from trainwarden.agent.node.agent import AgentConfig, NodeAgent
from trainwarden.agent.node.job_runner import JobRunner
from trainwarden.agent.node.liveness import KeepAlive
from trainwarden.agent.watchdog.loop import STALL_S, Watchdog

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def systemd(tmp_path):
    """The socket systemd would listen on, and a reader of what arrived there so far."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.setblocking(False)

    def received() -> list[str]:
        out = []
        while True:
            try:
                out.append(sock.recv(4096).decode())
            except BlockingIOError:
                return out

    received.address = str(tmp_path / "notify")
    yield received
    sock.close()


class StuckTelemetry:
    """Job telemetry whose first snapshot blocks until released: the watchdog loop is stuck in an iteration."""

    def __init__(self) -> None:
        self.release, self.entered = threading.Event(), threading.Event()

    def snapshot(self, job=None):
        self.entered.set()
        self.release.wait(20)
        return ()


def test_heartbeat_reports_a_stall_and_an_ended_thread():
    clock = Clock()
    beat = Heartbeat("pruning", stall_s=60, clock=clock)
    assert beat.problem(running=True) is None
    clock.now += 61
    assert beat.problem(running=True) == "pruning: no iteration finished for 61 s (limit 60 s)"
    beat.beat()
    assert beat.problem(running=True) is None
    assert beat.problem(running=False) == "pruning: its thread has ended"
    with pytest.raises(ValueError, match="stall_s must be positive"):
        Heartbeat("x", stall_s=0)


def test_keep_alives_stop_while_the_watchdog_loop_is_wedged_and_resume_after(systemd, caplog):
    clock, telemetry = Clock(), StuckTelemetry()
    watchdog = Watchdog(telemetry, actions=None, node="n1", clock=clock)
    watchdog.start()
    try:
        assert telemetry.entered.wait(10)  # the loop is inside its first iteration, and stays there
        keepalive = KeepAlive(SdNotifier(systemd.address, watchdog_s=30.0), watchdog.liveness, status="serving",
                              clock=clock)
        keepalive.tick()
        assert systemd() == ["READY=1\nWATCHDOG=1\nSTATUS=serving"]
        clock.now += 15  # within its limit: a slow iteration is not a wedged one
        keepalive.tick()
        assert systemd() == ["WATCHDOG=1"]
        with caplog.at_level(logging.ERROR, logger="trainwarden.agent.node.liveness"):
            for _ in range(3):
                clock.now += STALL_S
                keepalive.tick()
        sent = systemd()
        assert "WATCHDOG=1" not in "\n".join(sent)  # systemd kills the agent 30 s after the last one
        assert len(sent) == 3 and all(s.startswith("STATUS=wedged, keep-alives stopped: watchdog loop: no iteration")
                                      for s in sent)
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "watchdog loop: no iteration finished for" in errors[0]  # logged once

        telemetry.release.set()  # the iteration ends: the loop beats again
        wait_for(lambda: watchdog.liveness() is None, timeout=10, what="the watchdog loop to beat")
        clock.now += 15
        keepalive.tick()
        assert systemd() == ["WATCHDOG=1", "STATUS=serving"]
    finally:
        telemetry.release.set()
        watchdog.stop(5)


def test_ready_waits_for_a_check_that_passes(systemd):
    clock, problems = Clock(), ["telemetry server: its health check answers no socket", None]
    keepalive = KeepAlive(SdNotifier(systemd.address, watchdog_s=10.0), lambda: problems[0], status="serving",
                          clock=clock)
    keepalive.tick()
    assert systemd() == [] and not keepalive.ready
    assert keepalive.wait_s(1.0) == 0.5  # tried again soon
    problems.pop(0)
    clock.now += 0.5
    keepalive.tick()
    assert systemd() == ["READY=1\nWATCHDOG=1\nSTATUS=serving"] and keepalive.ready
    assert keepalive.wait_s(60.0) == 5.0  # half of WatchdogSec


def test_keep_alives_meant_for_another_process_are_not_sent(systemd):
    """WATCHDOG_PID names another process (the variables were inherited): ready, but no keep-alives."""
    clock, checks = Clock(), []
    notifier = SdNotifier.from_environment({"NOTIFY_SOCKET": systemd.address, "WATCHDOG_USEC": "2000000",
                                            "WATCHDOG_PID": "1"})
    keepalive = KeepAlive(notifier, lambda: checks.append(1), status="serving", clock=clock)
    for _ in range(10):
        keepalive.tick()
        clock.now += 1.0
    assert systemd() == ["READY=1\nSTATUS=serving"] and len(checks) == 1


def test_without_systemd_nothing_is_checked():
    def check():
        raise AssertionError("checked without NOTIFY_SOCKET")

    keepalive = KeepAlive(SdNotifier.from_environment({}), check, status="serving")
    keepalive.tick()
    keepalive.stopping("SIGTERM")
    assert keepalive.wait_s(1.0) == 1.0


def test_the_agent_is_live_while_its_parts_work_and_not_once_its_server_stops(tmp_path):
    agent = NodeAgent(AgentConfig(socket_path=tmp_path / "a.sock", node="n1", metrics_port=0, gpu_health=False,
                                  state_home=tmp_path / "state"))
    agent.start()
    try:
        assert agent.liveness(timeout=5) is None
        agent.server.stop(0)  # the socket is gone: no worker or probe can reach this agent any more
        assert agent.liveness(timeout=5) == "telemetry server: its health check answers no socket"
    finally:
        agent.stop()


def test_the_job_runner_survives_a_bad_round_and_reports_its_end(tmp_path):
    runner = JobRunner(client=None, node="n1", etcd="127.0.0.1:1", state_home=tmp_path, interval_s=0.01)
    rounds = []

    def reconcile_once():
        rounds.append(1)
        raise OSError(28, "No space left on device")

    runner.reconcile_once = reconcile_once
    runner.start()
    try:
        wait_for(lambda: len(rounds) >= 3, timeout=10, what="three rounds")
        assert runner.liveness() is None
    finally:
        runner.stop(5)
    assert runner.liveness() == "job runner: its thread has ended"

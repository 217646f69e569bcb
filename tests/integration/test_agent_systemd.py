"""`trainwarden agent` under systemd's notify protocol, as a real process talking to a socket the test listens on.

The test plays systemd: it binds the datagram socket ``NOTIFY_SOCKET`` names and sets ``WATCHDOG_USEC``, starts
the installed CLI in its own session (procs fixture: the group is killed whatever happens), and reads what
arrives: ``READY=1`` only once the agent answers its gRPC health check, ``WATCHDOG=1`` about every half
interval, ``STOPPING=1`` on SIGTERM.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import pytest

from trainwarden.agent.common import exit_codes
from trainwarden.agent.node.endpoints import check_agent

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "trainwarden.agent.cli"]
WATCHDOG_S = 2.0  # keep-alives every second


def receive(sock: socket.socket, agent, timeout: float) -> str:
    """The next notification, waiting at most `timeout` seconds; fails at once if the agent exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return sock.recv(4096).decode()
        except socket.timeout:
            assert agent.poll() is None, agent.log_path.read_text()
    raise TimeoutError(f"nothing from the agent within {timeout:.0f} s:\n{agent.log_path.read_text()}")


@pytest.mark.timeout(90)
def test_agent_is_ready_once_it_serves_keeps_alive_and_says_it_stops(procs, tmp_path):
    sock_path = tmp_path / "a.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(str(tmp_path / "notify"))
        systemd.settimeout(0.5)
        env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": str(int(WATCHDOG_S * 1e6))}
        agent = procs.spawn([*CLI, "agent", "--socket", str(sock_path), "--metrics-host", "127.0.0.1",
                             "--metrics-port", "0", "--node", "n1", "--state-home", str(tmp_path / "state")],
                            env=env, log=tmp_path / "agent.log")

        ready = receive(systemd, agent, timeout=60).split("\n")
        assert check_agent(sock_path) is None  # READY=1 came after the agent serves, not before
        assert ready[:2] == ["READY=1", "WATCHDOG=1"]
        assert ready[2].startswith(f"STATUS=serving: socket unix:{sock_path}, metrics http://127.0.0.1:")

        arrivals = []
        while len(arrivals) < 4:
            message = receive(systemd, agent, timeout=30)
            assert message == "WATCHDOG=1"
            arrivals.append(time.monotonic())
        # a keep-alive per half interval, never a burst: each is due a period after the previous check began, and
        # a check that passed took less than its health call's timeout (half a period)
        assert all(later - earlier >= WATCHDOG_S / 8 for earlier, later in zip(arrivals, arrivals[1:]))

        agent.send_signal(signal.SIGTERM)
        while (message := receive(systemd, agent, timeout=30)) == "WATCHDOG=1":  # sent before it exits
            pass
        assert message.split("\n") == ["STOPPING=1", "STATUS=stopping: SIGTERM"]
        assert agent.wait(timeout=30) == exit_codes.EXIT_OK, agent.log_path.read_text()
    log = agent.log_path.read_text()
    assert "told systemd the agent is ready" in log and "Traceback" not in log


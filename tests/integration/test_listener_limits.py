"""Idle connections do not take the node down (issue 44, item 7): real sockets, a real second uid, a real daemon.

The attacks: a member of the socket's group opens hundreds of telemetry streams that never say Hello, so that the
server's pool is full and a worker's stream and ``trainwarden agent --check`` are refused (RESOURCE_EXHAUSTED);
anyone who reaches the metrics port opens hundreds of idle TCP connections, each a thread of the root daemon.
The attacker is a child of this (root) test that drops to ``nobody`` with ``os.setresuid`` before it connects,
keeping gid 0 (a second user in the socket's group), as in test_stream_identity.py.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import urllib.request
from pathlib import Path

import grpc
import pytest

from procs import wait_for
from trainwarden.agent.shared import telemetry_pb2 as pb
from trainwarden.agent.shared.contract import STREAM_METHOD
from trainwarden.agent.telemetry.job_telemetry import JobTelemetry
from trainwarden.agent.telemetry.server import TelemetryServer
from trainwarden.runtime.session import init

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

NOBODY = 65534
CLI = [sys.executable, "-m", "trainwarden.agent.cli"]

IDLER = textwrap.dedent("""
    import os, sys, threading
    import grpc
    from trainwarden.agent.shared.contract import PEER_TOKEN_METADATA, STREAM_METHOD
    from trainwarden.runtime.agent_requests import fetch_peer_token

    sock, count, with_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with grpc.insecure_channel("unix:" + sock + ".absent") as warm:  # load gRPC's lazy parts while we may
        try:
            warm.unary_unary(STREAM_METHOD)(b"", timeout=0.2)
        except grpc.RpcError:
            pass
    os.setresuid(65534, 65534, 65534)
    never = threading.Event()

    def silence():  # a request stream that never sends a message
        never.wait()
        return
        yield

    channel = grpc.insecure_channel("unix:" + sock)
    stream = channel.stream_stream(STREAM_METHOD)
    calls = [stream(silence()) for _ in range(count)]
    for _ in range(with_tokens):  # its own uid's tokens, so that the agent knows who it is before any message
        calls.append(stream(silence(), metadata=((PEER_TOKEN_METADATA, fetch_peer_token(sock)),)))
    print("holding", os.getuid(), len(calls), flush=True)
    never.wait()  # until the test's procs fixture ends this process
""")


@pytest.fixture
def group_dir():
    """A directory a second user in root's group can traverse (pytest's tmp_path is under a 0700 one)."""
    top = Path(tempfile.mkdtemp(prefix="tw-limits-", dir="/tmp"))
    os.chmod(top, 0o750)
    yield top
    shutil.rmtree(top, ignore_errors=True)


def _idler(procs, tmp_path, sock: Path, count: int, with_tokens: int):
    script = tmp_path / "idler.py"
    script.write_text(IDLER)
    proc = procs.spawn([sys.executable, str(script), str(sock), str(count), str(with_tokens)],
                       log=tmp_path / "idler.log")
    wait_for(lambda: "holding" in proc.log_path.read_text() or proc.poll() is not None, 60, what="the idle streams")
    assert proc.poll() is None, proc.log_path.read_text()
    assert f"holding {NOBODY} {count + with_tokens}" in proc.log_path.read_text()
    return proc


def _check(sock: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "agent", "--check", "--socket", str(sock)], capture_output=True, text=True,
                          timeout=60, start_new_session=True)


def test_idle_streams_of_another_uid_leave_a_workers_stream_and_the_check_served(group_dir, procs, tmp_path):
    assert os.geteuid() == 0, "this test drops a child to another uid: the suite runs as root"
    js = JobTelemetry()
    # the shipped limits (256 streams, 64 per uid), and a Hello deadline long enough that only the caps protect
    server = TelemetryServer(group_dir / "run" / "agent.sock", js, hello_timeout_s=120)
    server.start()
    worker = None
    try:
        idler = _idler(procs, tmp_path, server.socket_path, count=300, with_tokens=80)
        wait_for(lambda: js.rejected()["limit"] >= 300 + 80 - 2 * 64, 60, what="the streams past the caps refused")
        held = server.open_streams()
        assert held == {"unidentified": 64, NOBODY: 64}, held  # the caps, whatever the attacker opens

        checked = _check(server.socket_path)
        assert checked.returncode == 0, checked.stderr  # `trainwarden agent --check` answers
        worker = init("victim", socket_path=str(server.socket_path), env={"RANK": "0", "WORLD_SIZE": "1"},
                      flush_interval_s=0.05)
        with worker.step(0):
            pass
        wait_for(lambda: any(r.verified and r.last_step == 0 for j in js.snapshot("victim") for r in j.ranks), 30,
                 what="the worker's stream accepted while the idle streams are held")
        assert server.open_streams()[0] == 1
        idler.kill()
    finally:
        if worker is not None:
            worker.close()
        server.stop(0.5)


def test_a_stream_that_never_says_hello_is_closed_after_the_deadline(tmp_path):
    js = JobTelemetry()
    server = TelemetryServer(tmp_path / "agent.sock", js, hello_timeout_s=1.0)
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            call = channel.stream_stream(STREAM_METHOD, request_serializer=pb.WorkerMessage.SerializeToString,
                                         response_deserializer=pb.AgentCommand.FromString)(iter(_silence()), timeout=60)
            with pytest.raises(grpc.RpcError) as ended:
                list(call)  # ends long before the call's own 60 s: the agent closes it
        assert ended.value.code() == grpc.StatusCode.CANCELLED, ended.value
        wait_for(lambda: js.rejected()["no_hello"] == 1, 10, what="the closed stream counted")
        assert server.open_streams() == {}
    finally:
        server.stop(0.5)


def _silence():
    import threading

    threading.Event().wait(120)
    yield pb.WorkerMessage()


def _threads(pid: int) -> int:
    return int(re.search(r"^Threads:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M).group(1))


def test_idle_connections_to_the_metrics_port_cost_the_daemon_no_threads(procs, tmp_path):
    sock = tmp_path / "a.sock"
    agent = procs.spawn([*CLI, "agent", "--socket", str(sock), "--metrics-host", "127.0.0.1", "--metrics-port", "0",
                         "--node", "n1", "--state-home", str(tmp_path / "state")], log=tmp_path / "agent.log")
    started = wait_for(lambda: re.search(r"metrics (http://127\.0\.0\.1:(\d+)/metrics)", agent.log_path.read_text())
                       or agent.poll() is not None, 60, what="the daemon's serving line")
    assert agent.poll() is None, agent.log_path.read_text()
    url, port = started.group(1), int(started.group(2))
    assert b"trainwarden_agent_info" in urllib.request.urlopen(url, timeout=30).read()
    before = _threads(agent.pid)
    idle = []
    try:
        for _ in range(200):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        for conn in idle[:20]:  # some send half a request line and stall
            conn.sendall(b"GET /metr")
        # the scrape is answered while they are all open, and the daemon grew no thread per connection
        assert b"trainwarden_agent_info" in urllib.request.urlopen(url, timeout=60).read()
        grown = _threads(agent.pid) - before
        assert grown <= 8, f"{grown} threads more with 200 idle connections open"  # the bounded pool at most
        # an idle connection is closed by the daemon (after the idle timeout), not held until the client leaves
        idle[-1].settimeout(60)
        assert idle[-1].recv(1) == b""
    finally:
        for conn in idle:
            conn.close()

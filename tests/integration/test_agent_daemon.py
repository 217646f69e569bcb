"""`trainwarden agent` as a real process: workers connect, `status`/`top` read it, SIGTERM stops it cleanly.

The agent is the installed CLI in its own session (procs fixture); the "workers" are real runtime
telemetry clients (`trainwarden.runtime.init(socket_path=...)`) in this process; `status`, `top` and
`agent --check` run as subprocesses, exactly as an operator would run them.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys

import pytest

from procs import wait_for
from trainwarden.agent.common import exit_codes
from trainwarden.runtime.session import init

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "trainwarden.agent.cli"]


def cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, start_new_session=True)


def start_agent(procs, tmp_path, name: str, *extra: str):
    return procs.spawn([*CLI, "agent", "--socket", str(tmp_path / f"{name}.sock"), "--metrics-host", "127.0.0.1",
                        "--node", "n1", "--state-home", str(tmp_path / "state"), *extra],
                       log=tmp_path / f"{name}.log")


@pytest.mark.timeout(90)
def test_agent_serves_status_and_top_then_stops_on_sigterm(procs, tmp_path):
    sock = tmp_path / "a.sock"
    agent = start_agent(procs, tmp_path, "a", "--metrics-port", "0")
    wait_for(lambda: cli("agent", "--check", "--socket", str(sock)).returncode == 0 or agent.poll() is not None,
             timeout=30, what="agent serving")
    assert agent.poll() is None, agent.log_path.read_text()
    # The socket answers a moment before the daemon logs its one "serving:" line: wait for the line, too.
    started = wait_for(lambda: re.search(r"serving: socket unix:(\S+), metrics (http://\S+/metrics)",
                                         agent.log_path.read_text()), timeout=30, what="the agent's serving line")
    assert started and started.group(1) == str(sock)
    metrics_url = started.group(2)

    # a second agent on the same socket refuses to start (one line, EXIT_USAGE) and leaves the first alone
    other = cli("agent", "--socket", str(sock), "--metrics-port", "0", "--metrics-host", "127.0.0.1")
    assert other.returncode == exit_codes.EXIT_USAGE, other.stderr
    assert "trainwarden agent: cannot start: another process is serving on" in other.stderr
    assert sock.exists()

    workers = [init("demo", env={"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"}, mesh={"dp": 2},
                    socket_path=str(sock), flush_interval_s=0.05) for r in range(2)]
    try:
        for step in range(4):
            for rt in workers:
                with rt.step(step, tokens=128):
                    pass

        def ranks():
            reply = json.loads(cli("status", "--socket", str(sock), "--json").stdout)
            jobs = {j["job"]: j for j in reply["jobs"]}
            return jobs.get("demo", {}).get("ranks", [])

        wait_for(lambda: [r["last_step"] for r in ranks()] == [3, 3], timeout=20, what="both ranks at step 3")
        rows = ranks()
        assert [r["rank"] for r in rows] == [0, 1] and all(r["connected"] for r in rows)
        assert all(r["step_p50_seconds"] > 0 and r["tokens_per_second"] > 0 for r in rows)

        table = cli("status", "--socket", str(sock))
        assert table.returncode == 0 and "job demo  2/2 ranks connected  world 2" in table.stdout

        top = cli("top", "--socket", str(sock), "--job", "demo", "--interval", "0.2", "--iterations", "2",
                  "--metrics-url", metrics_url)
        assert top.returncode == 0, top.stderr
        assert top.stdout.count("trainwarden top") == 2 and "\x1b[" not in top.stdout
        gpu_columns = [line.split()[6:8] for line in top.stdout.splitlines() if line[:1].isdigit()]
        assert gpu_columns == [["-", "-"]] * 4  # no GPU here: dashes, two ranks in two frames
    finally:
        for rt in workers:
            rt.close()

    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=30) == exit_codes.EXIT_OK, agent.log_path.read_text()
    assert not sock.exists()
    assert "Traceback" not in agent.log_path.read_text()
    assert cli("status", "--socket", str(sock)).returncode == exit_codes.EXIT_AGENT_UNAVAILABLE


@pytest.mark.timeout(60)
def test_unbindable_metrics_port_is_one_line_and_exit_usage(procs, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        agent = start_agent(procs, tmp_path, "c", "--metrics-port", str(taken.getsockname()[1]))
        assert agent.wait(timeout=30) == exit_codes.EXIT_USAGE
    log = agent.log_path.read_text()
    assert "trainwarden agent: cannot start" in log and "Traceback" not in log
    assert not (tmp_path / "c.sock").exists()


@pytest.mark.timeout(60)
def test_health_port_answers_grpc_health_checks_until_sigterm(procs, tmp_path):
    """What kubelet's grpc probe does: the standard health Check on a TCP port, answered by the agent itself."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    agent = start_agent(procs, tmp_path, "h", "--metrics-port", "0", "--health-port", "0")
    started = wait_for(lambda: re.search(r"serving: .*, health check grpc://127\.0\.0\.1:(\d+)",
                                         agent.log_path.read_text()) or agent.poll() is not None,
                       timeout=30, what="agent serving")
    assert agent.poll() is None, agent.log_path.read_text()
    target = f"127.0.0.1:{started.group(1)}"

    def check() -> int:
        with grpc.insecure_channel(target) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status

    assert check() == health_pb2.HealthCheckResponse.SERVING
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=30) == exit_codes.EXIT_OK, agent.log_path.read_text()
    with pytest.raises(grpc.RpcError) as gone:
        check()
    assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "Traceback" not in agent.log_path.read_text()


@pytest.mark.timeout(60)
def test_unbindable_health_port_is_one_line_and_exit_usage(procs, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        agent = start_agent(procs, tmp_path, "d", "--metrics-port", "0", "--health-port", str(port))
        assert agent.wait(timeout=30) == exit_codes.EXIT_USAGE
    problems = [line for line in agent.log_path.read_text().splitlines() if " INFO " not in line]
    assert problems == [f"trainwarden agent: cannot start: cannot serve the health check on 127.0.0.1:{port}: "
                        "Address already in use; another process holds it: stop it or choose another health port"]
    assert not (tmp_path / "d.sock").exists()

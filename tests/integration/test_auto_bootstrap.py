"""Auto-instrumentation's rules on a real worker process and a real agent telemetry server.

Each test runs tests/fixtures/unchanged/single_worker.py (a world of one, gloo, no trainwarden import unless
asked) with the environment the launcher gives workers (``worker_environment``: the bootstrap first on
PYTHONPATH) and reads what the agent heard: steps, their source, the streams opened. The job-level behaviour
(torchrun, hangs, restarts) is in test_unchanged_scripts.py.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from procs import wait_for
from trainwarden.agent.launch.torchrun import LaunchSpec, worker_bootstrap_dir, worker_environment
from trainwarden.agent.telemetry.job_telemetry import JobTelemetry
from trainwarden.agent.telemetry.server import TelemetryServer

pytestmark = pytest.mark.integration

WORKER = Path(__file__).resolve().parents[1] / "fixtures" / "unchanged" / "single_worker.py"


@pytest.fixture
def agent(tmp_path):
    js = JobTelemetry()
    srv = TelemetryServer(tmp_path / "agent.sock", js)
    srv.start()
    try:
        yield tmp_path / "agent.sock", js
    finally:
        srv.stop(0.5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(tmp_path, sock, job, *args, auto=True, extra_env=None, timeout=120) -> subprocess.CompletedProcess:
    spec = LaunchSpec(job=job, script=[str(WORKER)], rdzv_endpoint="127.0.0.1:1", state_dir=tmp_path / "state",
                      agent_socket=str(sock) if sock else None, auto_instrument=auto,
                      extra_env=dict(extra_env or {}))
    env = worker_environment(spec)
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.pop("TRAINWARDEN_AUTO_PID", None)
    return subprocess.run([sys.executable, str(WORKER), *args], env=env, capture_output=True, text=True,
                          timeout=timeout, start_new_session=True, cwd=tmp_path)


def rank0(js: JobTelemetry, job: str):
    snaps = js.snapshot(job)
    return snaps[0].ranks[0] if snaps and snaps[0].ranks else None


@pytest.mark.timeout(120)
def test_one_step_per_step_of_the_optimizer_that_steps_first(agent, tmp_path):
    sock, js = agent
    done = run_worker(tmp_path, sock, "two-opt", "--steps", "5", "--accumulate", "3", "--two-optimizers")
    assert done.returncode == 0, done.stderr
    wait_for(lambda: rank0(js, "two-opt") is not None and rank0(js, "two-opt").step_count == 5, 20,
             what="5 steps (one per step of the first optimizer, not per micro-batch nor per optimizer)")
    r = rank0(js, "two-opt")
    assert r.step_source == "optimizer hooks"
    assert r.last_step == 4  # Adam's own step count (5) - 1
    assert "trainwarden" not in done.stdout + done.stderr  # nothing said to the script's output


@pytest.mark.timeout(120)
def test_a_step_the_grad_scaler_skips_is_still_a_step(agent, tmp_path):
    sock, js = agent
    done = run_worker(tmp_path, sock, "scaler", "--steps", "4", "--scaler-skip", "1")
    assert done.returncode == 0, done.stderr
    assert "scaler skipped iteration 1" in done.stdout  # the scaler did skip optimizer.step()
    wait_for(lambda: rank0(js, "scaler") is not None and rank0(js, "scaler").step_count == 4, 20,
             what="4 steps, the skipped one included")


@pytest.mark.timeout(120)
def test_rt_step_wins_and_init_returns_the_auto_session_with_the_scripts_mesh(agent, tmp_path):
    sock, js = agent
    done = run_worker(tmp_path, sock, "manual", "--steps", "3", "--rt-step")
    assert done.returncode == 0, done.stderr
    assert "same session: True source=optimizer hooks" in done.stdout
    wait_for(lambda: rank0(js, "manual") is not None and rank0(js, "manual").step_count == 3, 20, what="3 steps")
    r = rank0(js, "manual")
    assert r.last_step == 102 and r.step_source == "rt.step"  # the script's own indices: the hooks stopped
    assert r.streams == 1  # one stream: init() did not open a second one
    assert js.snapshot("manual")[0].mesh == {"dp": 1}


@pytest.mark.timeout(150)
def test_spawned_dataloader_workers_stay_quiet(agent, tmp_path):
    sock, js = agent
    done = run_worker(tmp_path, sock, "loader", "--steps", "2", "--spawn-loader")
    assert done.returncode == 0, done.stderr
    assert "loader sum 112.0" in done.stdout
    wait_for(lambda: rank0(js, "loader") is not None and rank0(js, "loader").step_count == 2, 20, what="2 steps")
    r = rank0(js, "loader")
    assert r.streams == 1 and r.restart_count == 0  # the spawned children (same RANK) never connected
    assert len(js.snapshot()) == 1


@pytest.mark.timeout(150)
def test_the_users_sitecustomize_and_pythonpath_still_load_and_output_and_exit_code_are_unchanged(agent, tmp_path):
    sock, js = agent
    user = tmp_path / "userpath"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nUSER_MARK = 'mine'\nos.environ['USERMOD_LOADED'] = 'yes'\n")
    env = {"PYTHONPATH": str(user)}
    instrumented = run_worker(tmp_path, sock, "site", "--steps", "3", "--exit", "3", extra_env=env)
    plain = run_worker(tmp_path, None, "site-off", "--steps", "3", "--exit", "3", auto=False, extra_env=env)
    assert instrumented.returncode == plain.returncode == 3
    assert "sitecustomize: mine usermod: yes" in instrumented.stdout
    assert instrumented.stdout == plain.stdout
    wait_for(lambda: rank0(js, "site") is not None and rank0(js, "site").step_count == 3, 20, what="3 steps")
    assert rank0(js, "site-off") is None


def test_the_launcher_puts_the_bootstrap_first_and_keeps_the_users_path(tmp_path):
    base = {"PYTHONPATH": "/user/lib", "PATH": "/usr/bin"}
    on = worker_environment(LaunchSpec(job="j", script=["t.py"], rdzv_endpoint="h:1", state_dir=tmp_path,
                                       agent_socket="/s.sock", tokens_per_step=512), base=base)
    assert on["PYTHONPATH"] == f"{worker_bootstrap_dir()}:/user/lib"
    assert on["TRAINWARDEN_AUTO_INSTRUMENT"] == "1" and on["TRAINWARDEN_TOKENS_PER_STEP"] == "512"
    assert (Path(worker_bootstrap_dir()) / "sitecustomize.py").is_file()
    user_env = worker_environment(LaunchSpec(job="j", script=["t.py"], rdzv_endpoint="h:1", state_dir=tmp_path,
                                             agent_socket="/s.sock", extra_env={"PYTHONPATH": "/job/lib"}), base=base)
    assert user_env["PYTHONPATH"] == f"{worker_bootstrap_dir()}:/job/lib"  # the job's own --env path follows ours
    off = worker_environment(LaunchSpec(job="j", script=["t.py"], rdzv_endpoint="h:1", state_dir=tmp_path,
                                        agent_socket="/s.sock", auto_instrument=False), base=base)
    assert off["PYTHONPATH"] == "/user/lib" and off["TRAINWARDEN_AUTO_INSTRUMENT"] == "0"
    no_agent = worker_environment(LaunchSpec(job="j", script=["t.py"], rdzv_endpoint="h:1", state_dir=tmp_path),
                                  base=base)
    assert no_agent["TRAINWARDEN_AUTO_INSTRUMENT"] == "0"

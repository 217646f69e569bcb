"""Plain ``torchrun`` with `trainwarden agent` on the node: `trainwarden env` gives the unchanged script's
workers step times and hang recovery (docs/OPERATIONS.md, "Jobs started by plain torchrun").

Real parts: the installed CLI's agent (own session), plain torch.distributed.run with --max-restarts, the
tutorial DDP script that never imports trainwarden, SIGSTOP of one rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from procs import wait_for

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "trainwarden.agent.cli"]
SCRIPT = Path(__file__).resolve().parents[1] / "fixtures" / "unchanged" / "ddp_tutorial.py"


def cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, start_new_session=True)


def worker_with_rank(root: subprocess.Popen, rank: int) -> psutil.Process | None:
    """The training worker of ``rank`` among ``root``'s descendants (never a process this test did not start)."""
    for child in psutil.Process(root.pid).children(recursive=True):
        try:
            environ = child.environ()
            if environ.get("RANK") == str(rank) and "LOCAL_RANK" in environ and str(SCRIPT) in child.cmdline():
                return child
        except psutil.Error:
            continue
    return None


def ranks(sock: Path, job: str) -> list[dict]:
    reply = cli("status", "--socket", str(sock), "--json")
    if reply.returncode != 0:
        return []
    jobs = {j["job"]: j for j in json.loads(reply.stdout)["jobs"]}
    return jobs.get(job, {}).get("ranks", [])


@pytest.mark.timeout(240)
def test_plain_torchrun_with_trainwarden_env_gets_steps_and_hang_recovery(procs, tmp_path):
    sock, state = tmp_path / "agent.sock", tmp_path / "state"
    agent = procs.spawn([*CLI, "agent", "--socket", str(sock), "--metrics-host", "127.0.0.1", "--metrics-port", "0",
                         "--node", "n1", "--state-home", str(state)], log=tmp_path / "agent.log")
    wait_for(lambda: cli("agent", "--check", "--socket", str(sock)).returncode == 0 or agent.poll() is not None,
             timeout=30, what="agent serving")
    assert agent.poll() is None, agent.log_path.read_text()

    exported = cli("env", "--job", "plain", "--socket", str(sock), "--json")
    assert exported.returncode == 0, exported.stderr
    env = dict(os.environ, **json.loads(exported.stdout), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    shell = cli("env", "--job", "plain", "--socket", str(sock))
    assert f"export TRAINWARDEN_AGENT_SOCKET={sock}" in shell.stdout  # the form for eval "$(trainwarden env ...)"

    torchrun = procs.spawn([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "--max-restarts", "2", "--log-dir", str(tmp_path / "torchelastic"), str(SCRIPT),
                            "--steps", "150", "--sleep", "0.1"], log=tmp_path / "torchrun.log", env=env)
    wait_for(lambda: [(r["last_step"] or 0) >= 15 for r in ranks(sock, "plain")] == [True, True]
             or torchrun.poll() is not None,
             timeout=90, what="both ranks reporting steps")
    assert torchrun.poll() is None, torchrun.log_path.read_text()[-3000:]
    status = cli("status", "--socket", str(sock))
    assert "steps from optimizer hooks" in status.stdout and "steps/s" in status.stdout, status.stdout

    stopped = worker_with_rank(torchrun, 1)
    assert stopped is not None
    stopped.send_signal(signal.SIGSTOP)
    try:
        rc = torchrun.wait(180)
    finally:
        try:
            stopped.send_signal(signal.SIGCONT)
        except psutil.Error:
            pass
    log = torchrun.log_path.read_text()
    assert rc == 0, log[-3000:]
    assert "aborted by the trainwarden agent: hang" in log and "tutorial done" in log

    listed = cli("incidents", "--state-home", str(state), "--job", "plain", "--json")
    assert listed.returncode == 0, listed.stderr
    hangs = [i for i in json.loads(listed.stdout) if i["kind"] == "hang"]
    assert len(hangs) == 1 and hangs[0]["ranks"] == [1], hangs

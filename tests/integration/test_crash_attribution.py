"""A worker killed from outside (a real SIGKILL, not the fault injector) of a script that sends no
telemetry: the crash incident names it and calls the peers it took down collateral."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from procs import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

WORKER = Path(__file__).resolve().parents[1] / "e2e" / "idle_worker.py"


def test_an_external_sigkill_is_the_first_failure_and_the_peers_are_collateral(tmp_path, procs):
    pids = tmp_path / "pids"
    pids.mkdir()
    env = dict(os.environ, PIDS_DIR=str(pids), TRAINWARDEN_STATE_HOME=str(tmp_path / "state"), OMP_NUM_THREADS="1")
    log = tmp_path / "run.log"
    run = procs.spawn([sys.executable, "-m", "trainwarden.agent.cli", "run", "--metrics-port", "0",
                       "--nproc-per-node", "4", "--max-restarts", "0", "--job", "killed", "--", str(WORKER)],
                      log=log, env=env)
    wait_for(lambda: "step 3 " in log.read_text(), 120, what="three steps")
    os.kill(int((pids / "rank2.pid").read_text()), signal.SIGKILL)  # a worker this test started
    assert run.wait(120) != 0
    found = [json.loads(p.read_text()) for p in (tmp_path / "state" / "jobs" / "killed" / "incidents").glob("*.json")]
    [crash] = [i for i in found if i["kind"] == "crash"]
    assert crash["ranks"] == [2], crash
    reported = {f["global_rank"]: f for f in crash["evidence"]["failed_workers"]}
    assert reported[2]["cause"] == "SIGKILL" and reported[2]["exited_at"] > 0  # the launcher's exit clock
    assert crash["evidence"]["collateral"] == [0, 1, 3]  # exited 1 on the lost peer, or stopped by torchrun
    assert "incidents    crash 1 (rank 2; 3 collateral)" in log.read_text(), log.read_text()[-1500:]

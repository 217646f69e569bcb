"""The launcher's structured events (agent/launch/elastic.py): real torchrun with the reporting agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainwarden.agent.launch.elastic import EVENTS_FD_ENV

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

WORKER = Path(__file__).parent / "fail_once_worker.py"


def _run_reporting(tmp_path: Path, monitor_interval: float) -> tuple[int, list[dict], str]:
    read, write = os.pipe()
    env = {**os.environ, EVENTS_FD_ENV: str(write), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainwarden.agent.launch.elastic", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "1", "--monitor-interval", str(monitor_interval),
         "--log-dir", str(tmp_path / "torchelastic"), str(WORKER)],
        env=env, pass_fds=(write,), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    os.close(write)
    try:
        with os.fdopen(read) as pipe:
            events = [json.loads(line) for line in pipe]
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return rc, events, proc.stderr.read().decode()[-2000:]


def test_rounds_failures_with_exit_codes_and_error_files_and_restarts_are_reported_when_they_happen(tmp_path):
    # --monitor-interval 600: torch's loop polled every interval, so the failure and the end were seen only after
    # 600 s each (past this test's 120 s timeout). Now an exit wakes the agent, and the interval only bounds a wait.
    # (One run checks both: the reports, and that they come when the exits happen.)
    rc, events, stderr = _run_reporting(tmp_path, 600)
    assert rc == 0, stderr
    assert [e["event"] for e in events] == ["started", "failed", "restarting", "started", "finished"]
    first, failed, restarting, second, finished = events
    assert first["restart_count"] == 0 and sorted(w["global_rank"] for w in first["workers"]) == [0, 1]
    assert all(isinstance(w["pid"], int) and w["pid"] > 0 for w in first["workers"])
    [failure] = [f for f in failed["failures"] if f["global_rank"] == 1]
    assert failure["exitcode"] == 1 and "bad batch in shard 7" in failure["message"]
    assert restarting["reason"] == "failed" and restarting["restarts_left"] == 0  # after this one
    assert second["restart_count"] == 1
    assert {w["pid"] for w in second["workers"]}.isdisjoint({w["pid"] for w in first["workers"]})
    assert finished["state"] == "SUCCEEDED"


@pytest.mark.extended  # ~40 s; a second variant: the events' absence
def test_without_the_variable_it_is_plain_torchrun(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != EVENTS_FD_ENV}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, "-m", "trainwarden.agent.launch.elastic", "--standalone",
                          "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.2",
                          "--log-dir", str(tmp_path / "torchelastic"), str(WORKER)],
                         env=env, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]

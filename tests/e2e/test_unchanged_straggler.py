"""A straggler in a script that never imports trainwarden: auto-instrumentation's steps and the Flight Recorder's
collective arrivals are enough for the straggler detector to flag the slow rank and record its incident. And a
rank computing alone for a while (an evaluation) while the others wait is not taken for a hang."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parents[1] / "fixtures" / "unchanged" / "ddp_tutorial.py"


def incidents(tmp_path, job) -> list[dict]:
    directory = tmp_path / "state" / "jobs" / job / "incidents"
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))] if directory.exists() else []


@pytest.mark.timeout(300)
def test_a_slow_rank_of_an_unchanged_ddp_script_is_flagged_a_straggler(procs, tmp_path):
    log = tmp_path / "slow.log"
    proc = procs.spawn([sys.executable, "-m", "trainwarden.agent.cli", "run", "--nproc-per-node", "3",
                        "--max-restarts", "0", "--metrics-port", "0", "--job", "slow", "--state-home",
                        str(tmp_path / "state"), "--", str(SCRIPT), "--steps", "220", "--sleep", "0.05",
                        "--slow-rank", "2", "--slow-s", "0.12"], log=log)
    rc = proc.wait(240)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-3000:]
    assert "(from optimizer hooks)" in text
    stragglers = [i for i in incidents(tmp_path, "slow") if i["kind"].startswith("straggler")]
    assert stragglers and {r for i in stragglers for r in i["ranks"]} == {2}, stragglers
    assert [i for i in incidents(tmp_path, "slow") if i["kind"] == "hang"] == []


@pytest.mark.extended  # ~25 s; the default suite's rank computing alone is test_multinode.py's (one rank per node: the
# computing rank's node holds its own deadline as here, the waiting node learns it from etcd), the rule is
# tests/unit/test_hang.py's, and a rank whose child computes is test_hang_activity.py's
@pytest.mark.timeout(300)
def test_one_rank_computing_alone_for_seconds_is_not_a_hang(procs, tmp_path):
    log = tmp_path / "busy.log"
    proc = procs.spawn([sys.executable, "-m", "trainwarden.agent.cli", "run", "--nproc-per-node", "2",
                        "--max-restarts", "0", "--metrics-port", "0", "--job", "busy", "--state-home",
                        str(tmp_path / "state"), "--", str(SCRIPT), "--steps", "60", "--sleep", "0.05",
                        "--busy-rank", "0", "--busy-at", "30", "--busy-s", "12"], log=log)
    rc = proc.wait(240)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-3000:]  # the hang deadline is 2 s here; the evaluation took 12
    assert "tutorial done" in text and incidents(tmp_path, "busy") == []

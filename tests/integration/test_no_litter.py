"""A run leaves nothing behind outside its job's state directory: not torchrun's ``torchelastic_*`` log directories,
not the embedded etcd's data, not the agent's socket directory. Real `trainwarden run`, embedded etcd, torchrun and
workers that fail once (a restart, error files)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WORKER = Path(__file__).parent / "fail_once_worker.py"


def _everything(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_full_run_with_a_restart_leaves_nothing_outside_the_jobs_state_directory(procs, tmp_path):
    tmp, home = tmp_path / "tmp", tmp_path / "state"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "TRAINWARDEN_STATE_HOME": str(home), "OMP_NUM_THREADS": "1"}
    run = procs.spawn([sys.executable, "-m", "trainwarden.agent.cli", "run", "--metrics-port", "0",
                       "--nproc-per-node", "2", "--max-restarts", "1", "--job", "tidy", "--", str(WORKER)],
                      log=tmp_path / "run.log", env=env)
    assert run.wait(180) == 0, (tmp_path / "run.log").read_text()[-3000:]
    assert _everything(tmp) == []
    assert [p for p in _everything(home) if not p.startswith(os.path.join("jobs", "tidy"))] == ["jobs"]
    state = home / "jobs" / "tidy"
    assert not (state / "embedded-etcd").exists()
    assert list((state / "logs" / "torchelastic").rglob("error.json")), "torchrun's error files are the job's"

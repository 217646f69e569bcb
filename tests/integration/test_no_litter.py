"""A run leaves nothing behind outside its job's state directory: not torchrun's ``torchelastic_*`` log directories,
not the embedded etcd's data, not the agent's socket directory. Real `trainwarden run`, embedded etcd, torchrun and
workers that fail once (a restart, error files)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from procs import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WORKER = Path(__file__).parent / "fail_once_worker.py"


def _everything(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_full_run_with_a_restart_leaves_nothing_outside_the_jobs_state_directory(procs, tmp_path):
    tmp, home, shm = tmp_path / "tmp", tmp_path / "state", tmp_path / "shm"
    tmp.mkdir()
    shm.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "TRAINWARDEN_STATE_HOME": str(home), "OMP_NUM_THREADS": "1",
           "TRAINWARDEN_MEMORY_ROOT": str(shm)}
    run = procs.spawn([sys.executable, "-m", "trainwarden.agent.cli", "run", "--metrics-port", "0",
                       "--nproc-per-node", "2", "--max-restarts", "1", "--job", "tidy", "--", str(WORKER)],
                      log=tmp_path / "run.log", env=env)
    assert run.wait(180) == 0, (tmp_path / "run.log").read_text()[-3000:]
    assert _everything(tmp) == [] and _everything(shm) == []
    assert "memory snapshots in " + str(shm) in (tmp_path / "run.log").read_text()
    assert [p for p in _everything(home) if not p.startswith(os.path.join("jobs", "tidy"))] == ["jobs"]
    state = home / "jobs" / "tidy"
    assert not (state / "embedded-etcd").exists()
    assert list((state / "logs" / "torchelastic").rglob("error.json")), "torchrun's error files are the job's"


def test_what_a_sigkilled_run_left_in_tmp_is_removed_by_the_next_run(procs, tmp_path):
    """A SIGKILLed launcher cannot remove its agent's socket directory or its zygote's: they stayed in /tmp
    for good. The next run removes them (their owner mark names a process that is gone), and its memory
    snapshots' directory in shared memory likewise (an agent that restarts drops the snapshots of the one
    before)."""
    tmp, home, shm = tmp_path / "tmp", tmp_path / "state", tmp_path / "shm"
    tmp.mkdir()
    shm.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "TRAINWARDEN_STATE_HOME": str(home), "OMP_NUM_THREADS": "1",
           "TRAINWARDEN_MEMORY_ROOT": str(shm)}
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\ntime.sleep(120)\n")
    killed = procs.spawn([sys.executable, "-m", "trainwarden.agent.cli", "run", "--metrics-port", "0",
                          "--nproc-per-node", "1", "--job", "killed", "--", str(sleeper)],
                         log=tmp_path / "killed.log", env=env)
    wait_for(lambda: {p.name.split("-")[0] + "-" for p in tmp.iterdir()} >= {"trainwarden-", "tw-"}
             or killed.poll() is not None, 120, what="the run's scratch directories")
    assert killed.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
    procs.kill(killed)  # the launcher and everything it started, at once: nothing runs its cleanup
    killed.wait(30)
    left = _everything(tmp)
    assert any(p.startswith("trainwarden-") for p in left) and any(p.startswith("tw-warm-") for p in left), left
    assert [p.name for p in shm.iterdir() if p.name.startswith("trainwarden-mem-killed-")], _everything(shm)
    run = procs.spawn([sys.executable, "-m", "trainwarden.agent.cli", "run", "--metrics-port", "0",
                       "--nproc-per-node", "2", "--max-restarts", "1", "--job", "tidy", "--", str(WORKER)],
                      log=tmp_path / "run.log", env=env)
    assert run.wait(180) == 0, (tmp_path / "run.log").read_text()[-3000:]
    assert _everything(tmp) == [] and _everything(shm) == []


def test_a_pipeline_parallel_jobs_compile_cache_lives_and_ends_with_the_run(procs, tmp_path):
    """Importing ``torch.distributed.pipelining`` makes torch's compile cache, ``$TMPDIR/torchinductor_<user>``:
    the soak's pipeline-parallel job left one in every node's TMPDIR. The workers' cache is a directory of the
    run, removed when it ends."""
    tmp, home, shm = tmp_path / "tmp", tmp_path / "state", tmp_path / "shm"
    tmp.mkdir()
    shm.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "TRAINWARDEN_STATE_HOME": str(home), "OMP_NUM_THREADS": "1",
           "TRAINWARDEN_MEMORY_ROOT": str(shm)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    worker = tmp_path / "pipeline_worker.py"
    worker.write_text("import os\nimport torch.distributed.pipelining  # noqa: F401\n"
                      "print('compile cache:', os.environ.get('TORCHINDUCTOR_CACHE_DIR'), flush=True)\n")
    run = procs.spawn([sys.executable, "-m", "trainwarden.agent.cli", "run", "--metrics-port", "0",
                       "--nproc-per-node", "1", "--job", "pipe", "--", str(worker)], log=tmp_path / "run.log", env=env)
    assert run.wait(180) == 0, (tmp_path / "run.log").read_text()[-3000:]
    assert _everything(tmp) == [] and _everything(shm) == []
    assert "compile cache: " + str(tmp / "tw-inductor-") in (tmp_path / "run.log").read_text()

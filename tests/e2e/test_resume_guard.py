"""A job whose checkpoints cannot be read or loaded stops; it never trains from step 1 and exits 0.

Reproduces the issue "never throw a run away": with every checkpoint's .metadata gone (a lagging shared
filesystem) restore used to call them unfinished, start from step 1 and let retention delete them; with
every .metadata overwritten it set them aside as corrupt, and torchrun's restart then trained from step 1.
Real `trainwarden run`, embedded etcd, torchrun and the reference job on CPU."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

GPT = ["-m", "trainwarden.runtime.examples.gpt", "--dp", "1", "--tp", "1", "--pp", "2", "--ckpt-every", "4"]


def run_job(procs, tmp_path, name, steps, *extra):
    env = dict(os.environ, TRAINWARDEN_STATE_HOME=str(tmp_path / "state"), TRAINWARDEN_CKPT_READ_BACKOFF_S="0.2,0.2")
    log = tmp_path / f"{name}.log"
    run = procs.spawn([sys.executable, "-m", "trainwarden.agent.cli", "run", "--metrics-port", "0",
                       "--nproc-per-node", "2", "--max-restarts", "3", "--job", "keep", "--", *GPT,
                       "--steps", str(steps), *extra], log=log, env=env)
    return run.wait(200), log.read_text()


def cli(tmp_path, *args):
    env = dict(os.environ, TRAINWARDEN_STATE_HOME=str(tmp_path / "state"))
    return subprocess.run([sys.executable, "-m", "trainwarden.agent.cli", *args], env=env, capture_output=True,
                          text=True, timeout=60)


# metadata_garbage in the extended tier (~45-60 s): garbage metadata is also tests/unit/test_metadata_unpickler.py's
# and test_root_reads_checkpoints.py's
@pytest.mark.parametrize("damage", ["metadata_gone", pytest.param("metadata_garbage", marks=pytest.mark.extended)])
def test_damaged_checkpoints_stop_the_job_without_a_restart_and_are_kept(tmp_path, procs, damage):
    rc, log = run_job(procs, tmp_path, "first", 8)
    assert rc == 0, log[-3000:]
    ckpt = tmp_path / "state" / "jobs" / "keep" / "checkpoints"
    for step in (4, 8):
        meta = ckpt / f"step-{step:08d}" / ".metadata"
        meta.unlink() if damage == "metadata_gone" else meta.write_bytes(b"garbage\n")

    rc, log = run_job(procs, tmp_path, "again", 30)
    assert rc == 7, log[-4000:]  # EXIT_RESUME_BLOCKED, not 0 after training from step 1
    assert "step 1 loss" not in log and "restarting the worker group" not in log, log[-4000:]
    assert "the job stopped rather than start over" in log and "no restart was spent" in log
    stops = [line for line in log.splitlines() if "[rank " in line and "runtime.examples.gpt" in line]
    assert len(stops) == 2 and all("rank 0's error says why" in line and len(line) < 300 for line in stops), \
        stops  # rank 0's Checkpointer says why, once; each rank adds one short line that it stops
    left = sorted(p.name for p in ckpt.iterdir())
    if damage == "metadata_gone":  # a read problem: nothing set aside, nothing deleted
        assert left == ["latest", "step-00000004", "step-00000008"], left
        assert "storage problem" in log
    else:  # proof of corruption: set aside, never deleted
        assert left == ["latest", "step-00000004.corrupt", "step-00000008.corrupt"], left
    incidents = json.loads(cli(tmp_path, "incidents", "--job", "keep", "--json").stdout)
    kinds = [i["kind"] for i in incidents]
    assert kinds.count("resume_blocked") == 1 and "crash" not in kinds, kinds
    assert all(i["state"] == "failed" for i in incidents if i["kind"] == "checkpoint_set_aside")
    listing = cli(tmp_path, "checkpoints", "--job", "keep")
    assert listing.returncode == 0 and "step-00000008" in listing.stdout, listing
    assert "job keep failed" in log and "latest pointer names step 8, which is no longer complete" in log

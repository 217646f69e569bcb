"""The launcher records where the job checkpoints from what its workers report, never from the script's arguments
(issue 46: it scanned the user's argv for the reference job's ``--ckpt-dir``, a flag another script names
otherwise, so ``trainwarden checkpoints --job`` and ``report`` looked in the default directory)."""

from __future__ import annotations

import io
from pathlib import Path

from trainwarden.agent.common.paths import CHECKPOINT_DIR_RECORD, job_checkpoint_dir
from trainwarden.agent.launch.run import RunOptions, _JobRun
from trainwarden.agent.shared.contract import CHECKPOINT_DIR_ENV


def _run(tmp_path: Path, *script: str) -> _JobRun:
    job = _JobRun(RunOptions(script=["train.py", *script], job="j", state_home=str(tmp_path / "state")), io.StringIO())
    job.env = {CHECKPOINT_DIR_ENV: str(job.state_dir / "checkpoints")}  # what launch() gives the workers
    return job


def test_the_workers_report_of_their_directory_is_recorded_whatever_the_scripts_flag_is_called(tmp_path):
    job = _run(tmp_path, "--save-to", str(tmp_path / "mine"))
    assert job.checkpoint_dir == job.state_dir / "checkpoints"  # nothing reported yet: the workers' default
    job.on_checkpoint("j", 0, "restore_start", 0, str(tmp_path / "mine"), 0)
    assert job.checkpoint_dir == tmp_path / "mine"
    assert (job.state_dir / CHECKPOINT_DIR_RECORD).read_text() == f"{(tmp_path / 'mine').resolve()}\n"
    assert job_checkpoint_dir("j", tmp_path / "state") == (tmp_path / "mine").resolve()  # what the CLI reads


def test_a_commit_names_its_step_directory_whose_parent_is_recorded_and_other_jobs_are_ignored(tmp_path):
    job = _run(tmp_path)
    job.on_checkpoint("other", 0, "restore_start", 0, str(tmp_path / "theirs"), 0)
    job.on_checkpoint("j", 1, "snapshot", 3, str(tmp_path / "shm" / "step-3"), 0)  # memory: not the directory
    assert not (job.state_dir / CHECKPOINT_DIR_RECORD).exists()
    job.on_checkpoint("j", 0, "committed", 10, str(tmp_path / "ck" / "step-00000010"), 123)
    assert (job.state_dir / CHECKPOINT_DIR_RECORD).read_text() == f"{(tmp_path / 'ck').resolve()}\n"


def test_the_scripts_ckpt_dir_flag_alone_is_not_taken_for_the_directory(tmp_path):
    job = _run(tmp_path, "--ckpt-dir", str(tmp_path / "flag"))
    assert job.checkpoint_dir == job.state_dir / "checkpoints"  # until a worker says where it checkpoints

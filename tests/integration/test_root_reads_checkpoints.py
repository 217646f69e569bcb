"""Root lists a job's checkpoints and runs none of the job user's code (issue 44, item 1).

The job's user (``nobody``, a real second uid) owns its state directory and names its checkpoint directory in
``<state>/checkpoint_dir``; there, it plants ``step-N/.metadata`` holding a pickle whose ``__reduce__`` runs a
command. An operator runs the real CLI as root, as docs/OPERATIONS.md says to: ``trainwarden checkpoints --job J``
and ``trainwarden report --job J``. Before the allow-list unpickler the command ran as uid 0 (the marker file held
``0``); now nothing runs, the planted step is listed as unreadable naming the class, and a real checkpoint in the
same directory is still complete. The real checkpoint's commit marker, also nobody's, lists ``/dev/zero`` among its
files: ``checkpoints --verify`` read it without end as root; now that name is reported and not read.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from job_users import unavailable, shared_dir
from trainwarden.agent.common import exit_codes
from trainwarden.agent.common.job_history import JobHistory
from trainwarden.agent.common.paths import CHECKPOINT_DIR_RECORD, job_state_dir
from trainwarden.agent.shared import checkpoint_aside as asides
from trainwarden.agent.shared import checkpoint_layout as store

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

if unavailable():
    pytest.skip(unavailable(), allow_module_level=True)

NOBODY_UID = 65534
JOB = "planted"


class RunsACommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _as_nobody(script: str, *args: str, data: bytes = b"") -> None:
    """Run a shell script as uid/gid nobody (setpriv: no groups, no capabilities)."""
    subprocess.run(["setpriv", f"--reuid={NOBODY_UID}", f"--regid={NOBODY_UID}", "--clear-groups", "--",
                    "sh", "-c", script, "sh", *args], input=data, check=True, timeout=30)


def _chown_tree(top: Path) -> None:
    for root, dirs, files in os.walk(top):
        for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
            os.lchown(name, NOBODY_UID, NOBODY_UID)


@pytest.fixture
def planted(tmp_path):
    """(state home, marker): job ``planted`` of user nobody, its checkpoint directory of its own choosing with a
    real checkpoint at step 4 whose commit marker (nobody's) lists ``/dev/zero`` among its files and, written by
    nobody, a pickle that runs ``id -u > marker`` at step 8."""
    shared = shared_dir("tw-unpickle-")
    try:
        home, ckpt, marker = shared / "state", shared / "user-ckpt", shared / "ran-as"
        state = job_state_dir(JOB, home)
        history = JobHistory(state / "history", flush_every=3600)
        history.start()
        history.event("launched", t=1_700_000_000.0, node="n0", pid=1)
        history.step(0, 1, 1_700_000_001.0, 0.5)
        history.close()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"w": torch.ones(16), "lr": 0.1}, checkpoint_id=str(store.step_dir(ckpt, 4)), no_dist=True)
        _chown_tree(home / "jobs")  # what hand_over does: the job's state is its user's
        _chown_tree(ckpt)
        shared.chmod(0o777)  # so nobody may leave its marker when the pickle runs as nobody; root needs nothing
        payload = pickle.dumps({"storage_data": {}, "evil": RunsACommand(f"id -u > {marker}")})
        _as_nobody('echo "$1" > "$2/checkpoint_dir" && mkdir "$1/step-00000008" && cat > "$1/step-00000008/.metadata"',
                   str(ckpt), str(state), data=payload)
        endless = {"step": 4, "sums": {"algorithm": "xxh3_64", "files": {"/dev/zero": {"sum": "0", "bytes": 1}}}}
        _as_nobody('cat > "$1/step-00000004/COMMITTED"', str(ckpt), data=json.dumps(endless).encode())
        assert (state / CHECKPOINT_DIR_RECORD).stat().st_uid == NOBODY_UID
        assert (ckpt / "step-00000008" / ".metadata").stat().st_uid == NOBODY_UID
        yield home, marker
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def _cli(*args: str) -> subprocess.CompletedProcess:
    assert os.geteuid() == 0
    return subprocess.run([sys.executable, "-m", "trainwarden.agent.cli", *args], capture_output=True, text=True,
                          timeout=60)


def test_root_trainwarden_checkpoints_runs_nothing_of_a_planted_pickle(planted):
    home, marker = planted
    done = _cli("checkpoints", "--job", JOB, "--state-home", str(home), "--json")
    assert not marker.exists(), f"the planted pickle ran as uid {marker.read_text().strip()}"
    assert done.returncode == 0, done.stderr
    rows = {r["step"]: r for r in json.loads(done.stdout)["checkpoints"]}
    assert rows[8]["state"] == "unreadable"
    assert "the metadata names posix.system, which a checkpoint's metadata never holds" in rows[8]["detail"]
    assert rows[4]["state"] == "committed"


def test_root_trainwarden_report_runs_nothing_of_a_planted_pickle(planted):
    home, marker = planted
    page = home.parent / "report.html"
    done = _cli("report", "--job", JOB, "--state-home", str(home), "--out", str(page))
    assert not marker.exists(), f"the planted pickle ran as uid {marker.read_text().strip()}"
    assert done.returncode == 0, done.stderr
    table = page.read_text().split("<h2>Checkpoints</h2>")[1]
    assert "<td class=n>8</td><td>unreadable</td>" in table and "names posix.system" in table
    assert "<td class=n>4</td><td>complete</td>" in table


def test_root_trainwarden_checkpoints_verify_reads_only_the_checkpoints_files(planted):
    """``--verify`` hashes the files a commit marker lists; the marker is nobody's and names /dev/zero (before:
    root read it without end)."""
    home, marker = planted
    done = _cli("checkpoints", "--job", JOB, "--state-home", str(home), "--json", "--verify")
    assert done.returncode == exit_codes.EXIT_CHECKPOINT_CORRUPT, done.stderr
    rows = {r["step"]: r for r in json.loads(done.stdout)["checkpoints"]}
    assert rows[4]["state"] == "CORRUPT" and "/dev/zero" in rows[4]["verified"]
    assert "not a file name in the checkpoint directory: not read" in rows[4]["verified"]
    assert rows[8]["state"] == "unreadable" and not marker.exists()


def test_root_restore_aside_renames_nothing_through_a_planted_link(planted, tmp_path):
    """``checkpoints restore-aside`` (root, after fixing storage) renames in the job user's checkpoint directory.
    nobody plants a set-aside name that is a link to a root-only directory; with ``--force`` root renamed that
    directory's QUARANTINE.json before (and left step-12 a link to root's directory). Now it refuses by name."""
    home, _ = planted
    ckpt = home.parent / "user-ckpt"
    root_only = tmp_path / "root-only"
    root_only.mkdir(mode=0o700)
    (root_only / asides.QUARANTINE_NOTE).write_text('{"reason": "root\'s own"}')
    _as_nobody('ln -s "$2" "$1/step-00000012.corrupt"', str(ckpt), str(root_only))
    done = _cli("checkpoints", "--job", JOB, "--state-home", str(home), "restore-aside", "step-00000012.corrupt",
                "--force")
    assert sorted(p.name for p in root_only.iterdir()) == [asides.QUARANTINE_NOTE]
    assert not os.path.lexists(ckpt / "step-00000012")
    assert done.returncode == exit_codes.EXIT_USAGE, done.stdout
    assert "is a symbolic link or not a directory" in done.stderr

    # a real set-aside directory of the user's is still put back, its note renamed inside it
    _as_nobody('mkdir "$1/step-00000016.corrupt" && echo "{}" > "$1/step-00000016.corrupt/QUARANTINE.json"', str(ckpt))
    done = _cli("checkpoints", "--job", JOB, "--state-home", str(home), "restore-aside", "step-00000016.corrupt",
                "--force")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (ckpt / "step-00000016").iterdir()) == [f"{asides.QUARANTINE_NOTE}.restored"]

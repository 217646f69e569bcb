"""A rerun never trains beside a killed run's leftovers, and never beside a live run of the same job."""

import json
import subprocess
import sys

import psutil
import pytest

from trainwarden.agent.launch.run_record import RECORD_NAME, RunRecord, RunRecordError

pytestmark = pytest.mark.timeout(30)


def identity(pid):
    return {"pid": pid, "started": psutil.Process(pid).create_time()}


def sleeper(procs, tmp_path, name):
    return procs.spawn([sys.executable, "-c", "import time; time.sleep(60)"], log=tmp_path / f"{name}.log")


def test_leftovers_of_a_killed_run_are_stopped_and_the_record_cleared(tmp_path, procs):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_identity = {"pid": dead.pid, "started": psutil.Process(dead.pid).create_time()}
    dead.wait()
    torchrun, worker, bystander = (sleeper(procs, tmp_path, n) for n in ("torchrun", "worker", "bystander"))
    record = {"supervisor": dead_identity, "torchrun": identity(torchrun.pid), "etcd": None,
              "workers": [identity(worker.pid),
                          {"pid": bystander.pid, "started": 1.0}]}  # a pid reused by someone else: left alone
    (tmp_path / RECORD_NAME).write_text(json.dumps(record))
    stopped = RunRecord(tmp_path).adopt_or_clear()
    assert sorted(stopped) == sorted([torchrun.pid, worker.pid])
    assert torchrun.wait(5) is not None and worker.wait(5) is not None
    assert bystander.poll() is None
    assert not (tmp_path / RECORD_NAME).exists()


def test_a_live_run_of_the_same_job_is_not_run_beside(tmp_path, procs):
    other = sleeper(procs, tmp_path, "other-run")
    (tmp_path / RECORD_NAME).write_text(json.dumps({"supervisor": identity(other.pid)}))
    with pytest.raises(RunRecordError, match=f"already running here under trainwarden run pid {other.pid}"):
        RunRecord(tmp_path).adopt_or_clear()
    assert other.poll() is None


def test_the_record_names_what_the_run_started(tmp_path, procs):
    rec = RunRecord(tmp_path)
    assert rec.adopt_or_clear() == []
    child = sleeper(procs, tmp_path, "torchrun")
    rec.set("torchrun", child.pid)
    rec.set_workers([child.pid, 2**22 + 5])  # a worker already gone is not recorded
    data = json.loads((tmp_path / RECORD_NAME).read_text())
    assert data["torchrun"]["pid"] == child.pid and [w["pid"] for w in data["workers"]] == [child.pid]
    rec.remove()
    assert not (tmp_path / RECORD_NAME).exists()

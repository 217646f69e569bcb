"""The hang deadline's short floor against real work that stops the steps (issue 26): `trainwarden run` (real
torchrun, gloo on CPU, the in-process agent, 2 ranks) on an unchanged DDP script whose rank 0 pauses while the
other waits in a barrier.

- A DataLoader's worker preparing a new epoch's first batch for 6 s (the rank itself blocks, its child computes)
  and a 6 s read of a file in chunks (bytes move, little CPU) are work, not hangs: no incident, no restart.
  Before the watchdog counted the rank's children and its I/O, both were aborted (on the 5 s floor, too).
- A rank that only sleeps looks exactly like a hang; ``--hang-floor`` longer than the sleep lets it be.
- A hang whose waiting rank spins a core inside one call with its collective in flight (a GPU rank in a hung NCCL
  collective spins in a CUDA synchronize) is caught on the usual deadline. Before its training thread said so,
  the spin was taken for work and held the hang to the 300 s busy deadline.
"""

from __future__ import annotations

import sys

import pytest

from procs import ProcessGroup
from test_unchanged_scripts import FIXTURES, clean_env, incidents, wait

from trainwarden.agent.incidents import IncidentKind

pytestmark = pytest.mark.integration

SCRIPT = FIXTURES / "ddp_tutorial.py"


def _run(procs: ProcessGroup, tmp_path, job: str, launcher_flags: list[str], script_flags: list[str]) -> str:
    cmd = [sys.executable, "-m", "trainwarden.agent.cli", "run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--metrics-port", "0", "--job", job, "--state-home", str(tmp_path / "state"), *launcher_flags, "--",
           str(SCRIPT), "--steps", "16", "--sleep", "0.1", *script_flags]
    rc, text = wait(procs.spawn(cmd, log=tmp_path / f"{job}.log", env=clean_env()), procs, 240)
    assert rc == 0, text[-4000:]
    return text


@pytest.mark.timeout(300)
def test_a_dataloader_preparing_an_epoch_and_a_long_read_are_not_hangs(procs, tmp_path):
    text = _run(procs, tmp_path, "work", [], ["--pause", "6:loader:6", "--pause", "11:read:6"])
    assert incidents(tmp_path, "work") == [], text[-4000:]
    assert "tutorial done" in text


@pytest.mark.timeout(300)
def test_a_rank_that_sleeps_longer_than_the_floor_runs_on_with_a_longer_hang_floor(procs, tmp_path):
    text = _run(procs, tmp_path, "sleepy", ["--hang-floor", "9"], ["--pause", "6:sleep:5"])
    assert incidents(tmp_path, "sleepy") == [], text[-4000:]
    assert "tutorial done" in text


@pytest.mark.timeout(300)
def test_a_hang_whose_waiting_rank_spins_inside_one_call_is_caught_on_the_usual_deadline(procs, tmp_path):
    cmd = [sys.executable, "-m", "trainwarden.agent.cli", "run", "--nproc-per-node", "2", "--max-restarts", "0",
           "--metrics-port", "0", "--job", "spin", "--state-home", str(tmp_path / "state"), "--",
           str(SCRIPT), "--steps", "40", "--sleep", "0.1", "--stuck-peer", "12"]
    # the busy deadline is 300 s: a job still running after 150 s had its hang taken for work
    rc, text = wait(procs.spawn(cmd, log=tmp_path / "spin.log", env=clean_env()), procs, 150)
    assert rc != 0, text[-4000:]
    hangs = [i for i in incidents(tmp_path, "spin") if i.kind is IncidentKind.HANG]
    assert len(hangs) == 1, text[-4000:]
    evidence = hangs[0].evidence
    assert evidence["deadline"] == "steady" and evidence["timeout_seconds"] < 30, evidence
    assert 1 in hangs[0].ranks, hangs[0]  # the rank that stopped, not the one that spins waiting for it
    assert list(evidence["waiting_in_collective"]) == ["0"], evidence  # and the incident says who waited

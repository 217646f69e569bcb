"""A job on an etcd cluster survives the loss of a member (issue 10, item 6, first half): the run's clients
and torchrun's rendezvous are given every member (``--etcd a:2379,b:2379,c:2379``) and fail over.

On the multi-host test bed (tests/testbed.py): the job runs on node n0, the three etcd members on hosts of
their own; the member listed first, the one the clients start on, is killed mid-run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import wait_for
from testbed import TestBed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

if TestBed.unavailable():
    pytest.skip(TestBed.unavailable(), allow_module_level=True)

JOBS = Path(__file__).parents[1] / "jobs"


def _start_job(bed, tmp_path, job, steps):
    """``ddp_mlp.py`` on node n0 under `trainwarden run` against the bed's etcd cluster, once it trains."""
    env = dict(os.environ, TRAINWARDEN_STATE_HOME=str(tmp_path / "state"))
    log = tmp_path / "run.log"
    run = bed.spawn("n0", [sys.executable, "-m", "trainwarden.agent.cli", "run", "--metrics-port", "0",
                           "--nproc-per-node", "2", "--max-restarts", "1", "--job", job,
                           "--etcd", bed.etcd_endpoints, "--",
                           str(JOBS / "ddp_mlp.py"), "--steps", str(steps), "--sleep-ms", "40"], log=log, env=env)
    wait_for(lambda: f"job {job}: starting -> running" in log.read_text() or run.poll() is not None, 120,
             what="the job to start training")
    assert run.poll() is None, log.read_text()[-3000:]
    return run, log


def test_killing_the_etcd_member_the_clients_use_costs_the_job_nothing(tmp_path):
    with TestBed(nodes=1, etcd_members=3, workdir=tmp_path / "bed") as bed:
        run, log = _start_job(bed, tmp_path, "cluster", 300)
        time.sleep(2)
        bed.kill("e0")  # the first member: where every client of the run and of torchrun started
        assert run.wait(180) == 0, log.read_text()[-3000:]
        text = log.read_text()
        assert "last step 300" in text and "restarts     0" in text, text[-2000:]
        assert "round failed" not in text and "incidents" not in text.split("trainwarden: job cluster")[-1]
        # the run's final phase reached the cluster through a surviving member
        ctl = [str(Path(sys.executable).parent / "etcdctl"), "--endpoints", bed.etcd_endpoints,
               "--dial-timeout", "2s", "--command-timeout", "5s"]
        state = bed.run("n0", [*ctl, "get", "/trainwarden/v1/jobs/cluster/state", "--print-value-only"])
        assert '"phase": "succeeded"' in state.stdout, state.stdout + state.stderr
    assert bed.leftovers() == []
    assert "cluster" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_losing_etcd_quorum_stops_coordination_not_training(tmp_path):
    """Two of three members killed: no new rendezvous round can happen, but the running round trains on;
    the members come back and the job finishes without a restart."""
    with TestBed(nodes=1, etcd_members=3, workdir=tmp_path / "bed") as bed:
        run, log = _start_job(bed, tmp_path, "quorum", 400)
        bed.kill("e0")
        bed.kill("e1")
        time.sleep(8)  # longer than torchrun's monitor interval and the rendezvous keep-alive
        assert run.poll() is None, log.read_text()[-3000:]
        bed.start_etcd_member("e0")
        bed.start_etcd_member("e1")
        assert run.wait(240) == 0, log.read_text()[-3000:]
        text = log.read_text()
        assert "last step 400" in text and "restarts     0" in text, text[-2000:]
    assert bed.leftovers() == []


def _worker_pid(bed, node: str, rank: int) -> int:
    """The pid of local rank ``rank``'s worker on ``node`` (a warm worker's ``comm`` is ``tw-rank-R``)."""
    for pid in bed._pids(bed.hosts[node]):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == f"tw-rank-{rank}":
                return pid
        except OSError:
            continue
    raise AssertionError(f"no worker of rank {rank} on {node}")


@pytest.mark.extended  # 45 s; the retry's rules are tests/unit/test_rendezvous_etcd_away.py
def test_a_restart_while_etcd_has_lost_quorum_waits_for_it_and_goes_on(tmp_path):
    """A worker dies while two of three members are down: torchrun's restart needs a new round, which etcd
    cannot give until the quorum is back; the restart waits for it instead of ending the run (issue 45: the
    soak's `quorum` fault met a restart and torchrun exited 1 with RendezvousConnectionError)."""
    with TestBed(nodes=1, etcd_members=3, workdir=tmp_path / "bed") as bed:
        run, log = _start_job(bed, tmp_path, "quorumrestart", 400)
        bed.kill("e0")
        bed.kill("e1")
        time.sleep(2)
        os.kill(_worker_pid(bed, "n0", 1), 9)  # ours: the job this test started
        wait_for(lambda: "the restart waits for etcd" in log.read_text()
                 or run.poll() is not None, 60,
                 what="the restart to wait for etcd")
        assert run.poll() is None, log.read_text()[-3000:]
        time.sleep(4)  # past one more try
        assert run.poll() is None, log.read_text()[-3000:]
        bed.start_etcd_member("e0")
        bed.start_etcd_member("e1")
        assert run.wait(240) == 0, log.read_text()[-3000:]
        text = log.read_text()
        assert "last step 400" in text and "restarts     1" in text, text[-2000:]
    assert bed.leftovers() == []

"""One job-spec contract for `submit` and the daemon, and a refusal that is one incident, not a log line per poll
(issue 23, item 2): real etcd on loopback, real `trainwarden agent` daemons and `trainwarden run` launchers.

A spec submitted without ``checkpoint_dir`` used to be stored with a null there, which the daemon's reading refused
every 2 s forever; now it runs. A spec this node cannot run (its script missing here, or its record unreadable)
becomes one ``job_refused`` incident (in the state home and in etcd) and the phase ``refused`` with the reason,
counted over several of the daemon's rounds and across a daemon restart.
"""

from __future__ import annotations

import inspect
import json
import math
import signal
from pathlib import Path

import pytest

from procs import wait_for
from test_daemon_jobs import Daemons, _cli, _jobs
from trainwarden.agent.node.job_runner import NODE_RECORD_KEEPALIVE_S, JobRunner

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PREFIX = "/trainwarden/v1"


@pytest.fixture
def daemons(procs, tmp_path, etcd_server):
    d = Daemons(procs, tmp_path, etcd_server.endpoint)
    try:
        yield d
    finally:
        d.close()


def _write_spec(path: Path, **fields) -> Path:
    path.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in fields.items()) + "\n")
    return path


def _script(path: Path) -> Path:
    path.write_text("print('hello from a job without a checkpoint_dir', flush=True)\n")
    return path


def _rounds(etcd_client, node: str, n: int) -> None:
    """Wait until the daemon of ``node`` has finished at least ``n`` more rounds. Its node record is put only when it
    changes; on a round every ``NODE_RECORD_KEEPALIVE_S`` the daemon keeps the record's lease alive instead, which
    resets the lease's TTL: each reset seen is that many rounds (a new lease, after a restart, starts the count)."""
    interval = inspect.signature(JobRunner.__init__).parameters["interval_s"].default
    needed = math.ceil(n / max(1, math.ceil(NODE_RECORD_KEEPALIVE_S / interval))) + 1
    seen = {"lease": None, "ttl": 0, "resets": 0}

    def more() -> bool:
        _, meta = etcd_client.get(f"{PREFIX}/nodes/{node}")
        if meta is None or not meta.lease_id:
            return False
        ttl = int(etcd_client.get_lease_info(meta.lease_id).TTL)
        if meta.lease_id != seen["lease"]:
            seen.update(lease=meta.lease_id, ttl=ttl, resets=0)
            return False
        if ttl > seen["ttl"]:
            seen["resets"] += 1
        seen["ttl"] = ttl
        return seen["resets"] >= needed

    wait_for(more, 120, what=f"{n} rounds of the daemon on {node}")


def _incidents(etcd_client, home: Path, job: str) -> tuple[list[dict], list[dict]]:
    """The job's incidents in the node's state home and in etcd."""
    local = [json.loads(p.read_text()) for p in (home / "daemon" / "records" / job / "incidents").glob("*.json")]
    remote = [json.loads(v) for v, _ in etcd_client.get_prefix(f"{PREFIX}/jobs/{job}/incidents/")]
    return local, remote


@pytest.mark.extended  # ~45 s; a second variant of a daemon-run job (test_daemon_jobs.py runs several)
def test_a_spec_without_checkpoint_dir_runs_under_the_daemon(daemons, tmp_path, etcd_server):
    etcd = etcd_server.endpoint
    daemons.start("n0")
    spec = _write_spec(tmp_path / "nockpt.toml", name="nockpt", command=[str(_script(tmp_path / "hello.py"))])
    assert _cli("submit", str(spec), "--check", etcd=etcd).returncode == 0
    out = _cli("submit", str(spec), etcd=etcd)
    assert out.returncode == 0, out.stderr
    wait_for(lambda: _jobs(etcd)["nockpt"]["phase"] in ("succeeded", "refused", "failed"), 120,
             what="the job without a checkpoint_dir to finish")
    assert _jobs(etcd)["nockpt"]["phase"] == "succeeded", _jobs(etcd)["nockpt"]
    assert "hello from a job without a checkpoint_dir" in daemons.job_log("n0", "nockpt")
    assert "not usable" not in daemons.log("n0") and "refused" not in daemons.log("n0")


def test_a_job_this_node_cannot_run_is_refused_once_with_one_incident_then_runs_once_fixed(
        daemons, tmp_path, etcd_server, etcd_client):
    etcd = etcd_server.endpoint
    daemons.start("n0")
    script = tmp_path / "later.py"  # not there yet: the node cannot run the job
    spec = _write_spec(tmp_path / "later.toml", name="later", command=[str(script)], nodes=["n0"])
    assert _cli("submit", str(spec), etcd=etcd).returncode == 0
    wait_for(lambda: _jobs(etcd)["later"]["phase"] != "pending", 60, what="the daemon to decide on the job")
    job = _jobs(etcd)["later"]
    assert job["phase"] == "refused" and "refused by node n0" in job["reason"] and str(script) in job["reason"], job
    _rounds(etcd_client, "n0", 2)
    daemons.procs.kill(daemons.running["n0"], signal.SIGTERM)  # a restarted daemon does not record it again
    daemons.running["n0"].wait(30)
    daemons.start("n0")
    _rounds(etcd_client, "n0", 2)

    local, remote = _incidents(etcd_client, daemons.home("n0"), "later")
    assert [i["kind"] for i in local] == ["job_refused"] and remote == local, (local, remote)
    assert local[0]["node"] == "n0" and str(script) in local[0]["evidence"]["reason"]
    assert daemons.log("n0").count("job later generation 1: refused by node n0") == 1
    assert "later" not in daemons.launchers("n0")
    listed = _cli("jobs", etcd=etcd).stdout
    assert "refused" in listed and "refused by node n0" in listed

    _script(script)  # the operator fixes the node and resumes: a new generation is looked at afresh
    resumed = _cli("resume", "later", etcd=etcd)
    assert resumed.returncode == 0 and "generation 2" in resumed.stdout, resumed.stderr
    wait_for(lambda: _jobs(etcd)["later"]["phase"] == "succeeded", 120, what="the fixed job to succeed")
    assert len(_incidents(etcd_client, daemons.home("n0"), "later")[0]) == 1


def test_an_unreadable_spec_in_etcd_is_refused_once_not_logged_every_poll(daemons, etcd_server, etcd_client):
    """Also issue 30: a record written past `submit` whose env sets what trainwarden sets for the job (here the
    agent socket its workers would stream to) is refused the same way, never launched."""
    handmade = {"name": "handmade", "command": ["train.py"], "nproc_per_node": "2", "managed": True}
    hijack = {"name": "hijack", "command": ["train.py"], "env": {"TRAINWARDEN_AGENT_SOCKET": "/tmp/elsewhere.sock"},
              "managed": True}
    for record in (handmade, hijack):
        state = {"job": record["name"], "phase": "pending", "generation": 1, "restarts": 0, "last_change": 0.0,
                 "reason": "written by hand", "owner": {}}
        etcd_client.put(f"{PREFIX}/jobs/{record['name']}/spec", json.dumps(record))
        etcd_client.put(f"{PREFIX}/jobs/{record['name']}/state", json.dumps(state))
    daemons.start("n0")
    wait_for(lambda: all(_jobs(etcd_server.endpoint)[j]["phase"] != "pending" for j in ("handmade", "hijack")), 60,
             what="the daemon to decide on the jobs")
    job = _jobs(etcd_server.endpoint)["handmade"]
    assert job["phase"] == "refused" and "field 'nproc_per_node' must be a whole number" in job["reason"], job
    job = _jobs(etcd_server.endpoint)["hijack"]
    assert job["phase"] == "refused" and "entry 'TRAINWARDEN_AGENT_SOCKET' is trainwarden's" in job["reason"], job
    _rounds(etcd_client, "n0", 2)
    for name, word in (("handmade", "nproc_per_node"), ("hijack", "TRAINWARDEN_AGENT_SOCKET")):
        local, remote = _incidents(etcd_client, daemons.home("n0"), name)
        assert [i["kind"] for i in remote] == ["job_refused"] and remote == local
        assert daemons.log("n0").count(word) == 1, word
    assert "hijack" not in daemons.launchers("n0")

"""The node daemon's job runner learns of jobs from etcd watches, not by polling (issue 28): a real etcd on
loopback, a ``JobRunner`` in this process whose clock never moves (so its safety re-read never falls due), and jobs
whose script is missing, which the runner refuses (a ``job_refused`` incident, the generation ``refused``) without
starting any process. Whatever it notices, it notices through a watch or through the re-read a lost watch causes."""

from __future__ import annotations

import pytest

from procs import wait_for
from trainwarden.agent.common.job_spec import parse_job_spec
from trainwarden.agent.etcd.client import open_client
from trainwarden.agent.etcd.jobs import JobControl
from trainwarden.agent.node.job_runner import JobRunner

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _runner(client, tmp_path, *, interval_s: float, incidents: list) -> JobRunner:
    return JobRunner(client, node="n1", etcd="127.0.0.1:1", state_home=tmp_path / "home", interval_s=interval_s,
                     clock=lambda: 1000.0, record=lambda i: incidents.append(i) or i)


def _submit(control: JobControl, tmp_path, name: str) -> int:
    return control.submit(parse_job_spec({"name": name, "command": [str(tmp_path / "missing.py")]}, "test"))


def _refused(incidents: list, name: str) -> bool:
    return any(i.job == name and i.kind.value == "job_refused" for i in incidents)


def test_a_submitted_job_reaches_the_runner_through_its_watch_not_a_poll(etcd_server, etcd_client, tmp_path):
    incidents: list = []
    runner = _runner(etcd_client, tmp_path, interval_s=3600.0, incidents=incidents)  # no timer round in the test
    control = JobControl(etcd_client)
    runner.start()
    try:
        wait_for(lambda: runner.liveness() is None and "index" in runner._jobs.watches, 30, what="the first read")
        _submit(control, tmp_path, "watched")
        wait_for(lambda: _refused(incidents, "watched"), 30, what="the runner to see the job")
        assert control.job("watched").phase == "refused"
        phases = {s.labels["job"]: s.labels["phase"] for m in runner.collect() if m.name == "trainwarden_job_phase"
                  for s in m.samples if s.value == 1.0}
        wait_for(lambda: {s.labels["phase"] for m in runner.collect() if m.name == "trainwarden_job_phase"
                          for s in m.samples if s.value == 1.0 and s.labels["job"] == "watched"} == {"refused"}, 30,
                 what="the refused phase, through the index's event")
        assert phases.get("watched") in ("pending", "refused")
    finally:
        runner.stop(5)


def test_a_watch_lost_with_its_stream_is_noticed_and_the_jobs_are_read_again(etcd_server, tmp_path):
    incidents: list = []
    client = open_client("127.0.0.1", etcd_server.client_port, timeout=5.0)
    runner = _runner(client, tmp_path, interval_s=0.2, incidents=incidents)  # the clock is frozen: no safety re-read
    try:
        runner.start()
        wait_for(lambda: "index" in runner._jobs.watches and runner._jobs.watches["index"].alive(), 30, what="the watch")
        first = runner._jobs.watches["index"]
        etcd_server.stop()  # the watch stream breaks; python3-etcd3 tells no callback
        wait_for(lambda: not first.alive(), 30, what="the client to drop the watch")
        etcd_server.start()
        other = open_client("127.0.0.1", etcd_server.client_port, timeout=5.0)
        try:
            _submit(JobControl(other), tmp_path, "after-restart")
        finally:
            other.close()
        wait_for(lambda: _refused(incidents, "after-restart"), 60, what="the runner to read the jobs again")
        assert runner._jobs.watches["index"] is not first and runner._jobs.watches["index"].alive()
    finally:
        runner.stop(5)
        client.close()


def test_a_job_submitted_before_the_index_existed_is_indexed_and_run_at_the_daemons_start(etcd_client, tmp_path):
    control = JobControl(etcd_client)
    _submit(control, tmp_path, "older")
    etcd_client.delete(control.index_key("older"))  # as an older `trainwarden submit` left it
    incidents: list = []
    runner = _runner(etcd_client, tmp_path, interval_s=3600.0, incidents=incidents)
    runner.start()
    try:
        wait_for(lambda: _refused(incidents, "older"), 30, what="the runner to find the job")
        assert etcd_client.get(control.index_key("older"))[0] is not None
    finally:
        runner.stop(5)

"""A launch that fails is one refusal, not a traceback every round (issue 44, item 9): a real etcd on loopback and a
``JobRunner`` in this process whose launcher cannot be started (``Popen`` fails: here its interpreter is missing;
in the issue, a NUL in an env key that `submit` now refuses). Before, each round raised out of ``_launch`` and the
job stayed ``pending`` for ever."""

from __future__ import annotations

import os

import pytest

from procs import wait_for
from trainwarden.agent.common.job_spec import parse_job_spec
from trainwarden.agent.etcd.jobs import JobControl
from trainwarden.agent.node.job_runner import JobRunner

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_a_launch_that_fails_refuses_the_job_once_with_one_incident(etcd_server, etcd_client, tmp_path, caplog):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    incidents: list = []
    runner = JobRunner(etcd_client, node="n1", etcd="127.0.0.1:1", state_home=tmp_path / "home", interval_s=0.05,
                       python=str(tmp_path / "no-such-python"), default_user=str(os.geteuid()), allow_root_jobs=True,
                       record=lambda i: incidents.append(i) or i)
    control = JobControl(etcd_client)
    runner.start()
    try:
        control.submit(parse_job_spec({"name": "nolaunch", "command": [str(script)]}, "test"))
        wait_for(lambda: control.job("nolaunch").phase == "refused", 30, what="the job to be refused")
        runner.stop(5)
        for _ in range(20):  # more rounds, in this thread now: nothing more is recorded, nothing raises
            runner.reconcile_once()
    finally:
        runner.stop(5)
    assert [i.kind.value for i in incidents] == ["job_refused"], incidents
    assert "its launcher cannot be started" in incidents[0].evidence["reason"]
    assert "no-such-python" in control.job("nolaunch").state.get("reason", ""), control.job("nolaunch").state
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]

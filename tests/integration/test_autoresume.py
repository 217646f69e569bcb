"""A failed job resumes with no human involved (issue 12): real etcd, a real `trainwarden agent` daemon serving the
Alertmanager webhook, real Prometheus evaluating dashboards/prometheus/alerts.yml, real Alertmanager configured
from deploy/alertmanager.yml, real launchers, torchrun and gloo workers of the reference GPT.

The job (max_restarts 0) crashes at step 14; the daemon exports ``trainwarden_job_phase{phase="failed"}``;
TrainwardenJobFailed fires; Alertmanager posts it to the webhook; the daemon resumes the job as generation 2,
which restores the checkpoint of step 10 and finishes. Then the webhook is fed what it must refuse, and nothing
resumes anything.
"""

from __future__ import annotations

import json
import shutil

import pytest

from alerting import RESUMED, TOKEN, AlertingBed, alertmanager_binary, payload, run_failed_job, steps
from procs import wait_for
from trainwarden.agent.etcd.keys import job_key

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420),
              pytest.mark.skipif(shutil.which("prometheus") is None or alertmanager_binary() is None,
                                 reason="prometheus and prometheus-alertmanager not installed (Debian packages)")]


@pytest.fixture
def bed(procs, tmp_path, etcd_server):
    b = AlertingBed(procs, tmp_path, etcd_server.endpoint)
    try:
        yield b.start()
    finally:
        b.close()


def test_a_failed_job_resumes_from_its_checkpoint_through_prometheus_alertmanager_and_the_webhook(
        bed, tmp_path, etcd_server):
    timings = run_failed_job(bed, "ar")
    print("fault -> first step after the alert-driven resume:",
          ", ".join(f"{k} {v:.1f} s" for k, v in timings.items() if k != "failed"))
    log = bed.job_log("ar")
    gen2 = log[log.find(RESUMED):]
    # generation 1 crashed at 14 (committed 5, 10); generation 2 restored step 10 and ran 11..30 once each
    assert steps(log[:log.find(RESUMED)]) == list(range(1, 14)), log[-3000:]
    assert gen2.startswith(RESUMED + " 10"), gen2[:300]
    assert steps(gen2) == list(range(11, 31)), steps(gen2)

    (accepted,) = bed.incidents("ar", "auto_resume")
    assert accepted["evidence"]["decision"] == "accepted" and accepted["action"] == "resumed as generation 2"
    assert accepted["evidence"]["alert"]["alertname"] == "TrainwardenJobFailed"
    assert bed.metric("trainwarden_webhook_decisions_total", decision="accepted") == 1.0
    wait_for(lambda: bed.metric("trainwarden_job_phase", job="ar", generation="2", phase="succeeded") == 1.0, 30,
             what="the daemon to export generation 2 as succeeded")
    assert bed.metric("trainwarden_job_phase", job="ar", generation="2", phase="failed") == 0.0

    # ---- what the webhook must refuse: nothing of it resumes anything -----------------------------------
    body = json.dumps(payload("ar", 1)).encode()
    assert bed.post(body, token=None)[0] == 401
    assert bed.post(body, token="wrong-" + TOKEN)[0] == 401
    assert bed.post(body, token=TOKEN[:-1])[0] == 401
    code, reply = bed.post(b'{"version": "4", "alerts": "no"}')
    assert code == 400 and "receiver" in reply["error"], reply
    assert bed.post(b"not json")[0] == 400
    assert bed.post(json.dumps({**payload("ar", 1), "version": "3"}).encode())[0] == 400
    assert bed.post(b"x" * (300 * 1024))[0] == 413
    code, reply = bed.post(body)  # Alertmanager's repeat of the notification that resumed generation 1
    assert code == 200 and reply["decisions"][0]["decision"] == "duplicate", reply
    code, reply = bed.post(json.dumps(payload("ar", 2)).encode())  # generation 2 succeeded: not failed
    assert reply["decisions"][0]["decision"] == "rejected" and "succeeded" in reply["decisions"][0]["reason"]
    code, reply = bed.post(json.dumps(payload("nosuchjob", 1)).encode())
    assert reply["decisions"][0] == {"decision": "rejected", "reason": "etcd has no such job", "job": "nosuchjob"}
    code, reply = bed.post(json.dumps(payload("ar", 2, action=None, alertname="TrainwardenStraggler")).encode())
    assert reply["decisions"][0]["decision"] == "ignored"

    jobs = json.loads(__import__("subprocess").run(
        [__import__("sys").executable, "-m", "trainwarden.agent.cli", "jobs", "--json", "--etcd", bed.etcd],
        capture_output=True, text=True, timeout=60).stdout)
    assert [(j["job"], j["generation"], j["phase"]) for j in jobs] == [("ar", 2, "succeeded")]
    assert bed.metric("trainwarden_webhook_decisions_total", decision="accepted") == 1.0
    assert bed.metric("trainwarden_webhook_decisions_total", decision="duplicate") == 1.0
    for code in ("400", "401", "413"):
        assert bed.metric("trainwarden_webhook_requests_total", code=code) >= 1.0
    kinds = [i["evidence"]["decision"] for i in bed.incidents("ar", "auto_resume")]
    assert sorted(kinds) == ["accepted", "duplicate", "rejected"], kinds


def test_racing_resumes_of_one_failed_generation_make_one_new_generation(etcd_client):
    """Several daemons may receive the same alert: one etcd transaction per (job, generation) decides."""
    import threading

    from trainwarden.agent.common.job_spec import JobSpec
    from trainwarden.agent.etcd.jobs import JobConflict, JobControl

    control = JobControl(etcd_client)
    assert control.submit(JobSpec(name="race", command=("train.py",)), by="test") == 1
    state = json.loads(etcd_client.get(job_key("race", "state"))[0])
    etcd_client.put(job_key("race", "state"), json.dumps({**state, "phase": "failed"}))
    results, barrier = [], threading.Barrier(6)

    def resume():
        barrier.wait()
        try:
            results.append(control.resume_once("race", 1, by="test", record={}))
        except JobConflict as exc:
            results.append(str(exc))

    threads = [threading.Thread(target=resume) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results.count(2) == 1, results
    assert len(control.auto_resumes("race")) == 1
    view = control.job("race")
    assert (view.generation, view.phase) == (2, "pending")
    with pytest.raises(JobConflict, match="not failed"):
        control.resume_once("race", 2, by="test", record={})

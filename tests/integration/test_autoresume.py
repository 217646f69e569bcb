"""A failed job resumes with no human involved (issue 12): real etcd, a real `trainwarden agent` daemon serving the
Alertmanager webhook, real Prometheus evaluating dashboards/prometheus/alerts.yml, real Alertmanager configured
from deploy/alertmanager.yml, real launchers, torchrun and gloo workers of the reference GPT.

The job (max_restarts 0) crashes at step 14; the daemon exports ``trainwarden_job_phase{phase="failed"}``;
TrainwardenJobFailed fires; Alertmanager posts it to the webhook; the daemon resumes the job as generation 2,
which restores the checkpoint of step 10 and finishes. Then the webhook is fed what it must refuse, and nothing
resumes anything.
"""

from __future__ import annotations

import calendar
import json
import shutil
import time
from pathlib import Path

import pytest

from alerting import TOKEN, AlertingBed, PhaseWatch, alertmanager_binary, payload, steps
from procs import wait_for
from trainwarden.agent.etcd.client import open_client
from trainwarden.agent.etcd.keys import job_key

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420),
              pytest.mark.skipif(shutil.which("prometheus") is None or alertmanager_binary() is None,
                                 reason="prometheus and prometheus-alertmanager not installed (Debian packages)")]


RESUMED = "[rank 0] trainwarden.runtime.examples.gpt: resumed from checkpoint step"


def _spec(path: Path, name: str, ckpt: Path) -> Path:
    fields = {"name": name, "nnodes": "1", "nproc_per_node": 2, "checkpoint_dir": str(ckpt), "max_restarts": 0,
              "command": ["-m", "trainwarden.runtime.examples.gpt", "--batch", "4", "--steps", "30",
                          "--ckpt-every", "5"],
              }
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items())
                    + 'env = { TRAINWARDEN_FAULTS = "crash:rank=1,step=14" }\n')
    return path


@pytest.fixture
def bed(procs, tmp_path, etcd_server):
    b = AlertingBed(procs, tmp_path, etcd_server.endpoint)
    try:
        yield b.start()
    finally:
        b.close()


def _iso(text: str) -> float:
    whole, _, frac = text.rstrip("Z").partition(".")
    return calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S")) + float(f"0.{frac or 0}")


def run_failed_job_to_resumed(bed: AlertingBed, tmp_path: Path, etcd_server, job: str = "ar") -> dict[str, float]:
    """Submit the crashing job, wait for the alert-driven resume to finish it; the timings (seconds)."""
    import subprocess
    import sys

    client = open_client("127.0.0.1", etcd_server.client_port, timeout=5.0)
    watch = PhaseWatch(client, job_key(job, "state")).start()
    try:
        out = subprocess.run([sys.executable, "-m", "trainwarden.agent.cli", "submit",
                              str(_spec(tmp_path / f"{job}.toml", job, tmp_path / "ckpt")), "--etcd", bed.etcd],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        wait_for(lambda: watch.first(1, "failed") is not None, 240, what="generation 1 to fail at step 14")
        wait_for(lambda: watch.first(2, "pending") is not None, 120,
                 what="the alert to resume the job:\n" + bed.daemon_log()[-2000:])
        first_step: list[float] = []

        def resumed_and_stepped():
            log = bed.job_log(job)
            after = log[log.find(RESUMED):] if RESUMED in log else ""
            if steps(after) and not first_step:
                first_step.append(time.time())
            return watch.first(2, "succeeded") is not None or watch.first(2, "failed") is not None

        wait_for(resumed_and_stepped, 240, interval=0.1, what="generation 2 to finish:\n" + bed.job_log(job)[-3000:])
        assert watch.first(2, "succeeded") is not None, bed.job_log(job)[-3000:]
        (record,) = [json.loads(v) for v, _ in client.get_prefix(job_key(job, "autoresume", ""))]
    finally:
        watch.stop()
        client.close()
    failed = watch.first(1, "failed").at
    fired = _iso(record["startsAt"])
    return {"failed": failed, "rule": fired - failed, "alertmanager": record["received_at"] - fired,
            "webhook": record["at"] - record["received_at"],
            "resume": (first_step[0] if first_step else float("nan")) - record["at"],
            "total": (first_step[0] if first_step else float("nan")) - failed}


def test_a_failed_job_resumes_from_its_checkpoint_through_prometheus_alertmanager_and_the_webhook(
        bed, tmp_path, etcd_server):
    timings = run_failed_job_to_resumed(bed, tmp_path, etcd_server)
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

"""The Alertmanager webhook (agent/node/webhook.py): the request checks on a real HTTP(S) server on loopback, the
payload validation, and the decisions against a fake job store (the real etcd path: test_autoresume.py and
test_job_records.py)."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from alerting import payload  # noqa: E402
from trainwarden.agent.etcd.jobs import JobConflict, JobView  # noqa: E402
from trainwarden.agent.node.webhook import (AlertmanagerWebhook, AlertResumer, PayloadError,  # noqa: E402
                                            WebhookConfig, parse_payload)

TOKEN = "s3cret-token-0123456789"


class FakeControl:
    """The part of JobControl the resumer uses, over a dict of jobs."""

    def __init__(self) -> None:
        self.views: dict[str, JobView] = {}
        self.resumes: dict[str, list[dict]] = {}
        self.fail_with: Exception | None = None

    def add(self, name: str, phase: str, generation: int = 1, *, managed: bool = True, **spec) -> None:
        spec = {"name": name, "command": ["train.py"], **spec}
        self.views[name] = JobView(name, spec={**spec, **({"managed": True} if managed else {})},
                                   state={"phase": phase, "generation": generation})

    def job(self, name: str) -> JobView | None:
        if self.fail_with is not None:
            raise self.fail_with
        return self.views.get(name)

    def auto_resumes(self, name: str) -> list[dict]:
        return list(self.resumes.get(name, []))

    def resume_once(self, name: str, generation: int, *, by: str, record: dict) -> int:
        view = self.views[name]
        if any(r["generation"] == generation for r in self.resumes.get(name, [])):
            raise JobConflict(f"job {name} generation {generation} was resumed meanwhile")
        self.resumes.setdefault(name, []).append({**record, "at": now[0], "generation": generation,
                                                  "resumed_as": generation + 1})
        view.state = {"phase": "pending", "generation": generation + 1}
        return generation + 1


now = [1_000_000.0]


def _alert(job: str | None = "gpt", generation: int | None = 1, **kw) -> dict:
    return payload(job or "x", generation, **kw)["alerts"][0] | (
        {} if job else {"labels": {"alertname": "TrainwardenJobFailed", "trainwarden_action": "resume"}})


@pytest.fixture
def control():
    return FakeControl()


@pytest.fixture
def resumer(control):
    recorded = []
    r = AlertResumer(control, node="n0", resumes_per_hour=2, record=recorded.append, clock=lambda: now[0])
    r.recorded = recorded
    return r


def test_a_failed_job_is_resumed_once_per_generation(control, resumer):
    control.add("gpt", "failed", 1)
    first = resumer.decide(_alert())
    assert (first.decision, first.resumed_as) == ("accepted", 2)
    again = resumer.decide(_alert())  # Alertmanager repeats the notification
    assert again.decision == "duplicate" and "generation 1 was resumed already, as generation 2" in again.reason
    assert [i.evidence["decision"] for i in resumer.recorded] == ["accepted", "duplicate"]
    assert resumer.recorded[0].action == "resumed as generation 2"
    assert resumer.counts["accepted"] == 1 and resumer.counts["duplicate"] == 1


def test_an_alert_without_a_generation_is_refused_and_resumes_nothing(control, resumer):
    """issue 44 item 9: a replayed alert without a generation resumed whatever generation failed at the time."""
    control.add("gpt", "failed", 3)
    decision = resumer.decide(_alert(generation=None))
    assert decision.decision == "rejected" and "no generation label" in decision.reason
    assert control.views["gpt"].state == {"phase": "failed", "generation": 3} and not control.resumes
    assert resumer.decide(_alert(generation=3)).decision == "accepted"


def test_resumes_are_throttled_per_job_per_hour(control, resumer):
    control.add("gpt", "failed", 1)
    assert resumer.decide(_alert(generation=1)).decision == "accepted"
    control.views["gpt"].state = {"phase": "failed", "generation": 2}
    now[0] += 600
    assert resumer.decide(_alert(generation=2)).decision == "accepted"
    control.views["gpt"].state = {"phase": "failed", "generation": 3}
    third = resumer.decide(_alert(generation=3))
    assert third.decision == "throttled" and "trainwarden resume gpt" in third.reason
    now[0] += 3600  # the first two fall out of the hour
    assert resumer.decide(_alert(generation=3)).decision == "accepted"


@pytest.mark.parametrize("setup, alert, reason", [
    (lambda c: c.add("gpt", "stopped"), _alert(), "the job is stopped, not failed"),
    (lambda c: c.add("gpt", "running"), _alert(), "the job is running, not failed"),
    (lambda c: c.add("gpt", "failed", managed=False), _alert(), "started by hand"),
    (lambda c: c.add("gpt", "failed", auto_resume=False), _alert(), "auto_resume = false"),
    (lambda c: c.add("gpt", "failed", 3), _alert(generation=2), "about generation 2; the job is in generation 3"),
    (lambda c: None, _alert(), "etcd has no such job"),
    (lambda c: c.add("gpt", "failed"), _alert(job=None), "no job label"),
    (lambda c: c.add("gpt", "failed"), payload("../etc", 1)["alerts"][0], "is not a job name"),
])
def test_what_is_rejected_and_why(control, resumer, setup, alert, reason):
    setup(control)
    decision = resumer.decide(alert)
    assert decision.decision == "rejected" and reason in decision.reason, decision
    assert not control.resumes


def test_resolved_alerts_and_alerts_that_ask_for_nothing_are_ignored_and_not_recorded(control, resumer):
    control.add("gpt", "failed")
    assert resumer.decide(_alert(status="resolved")).decision == "ignored"
    assert resumer.decide(_alert(action=None)).decision == "ignored"
    assert not resumer.recorded and not control.resumes and resumer.counts["ignored"] == 2


@pytest.mark.parametrize("body, message", [
    (b"{", "not JSON"),
    (b"[]", "the payload must be an object"),
    (json.dumps({**payload("gpt", 1), "version": "3"}).encode(), 'version must be "4"'),
    (json.dumps({k: v for k, v in payload("gpt", 1).items() if k != "receiver"}).encode(), "receiver must be"),
    (json.dumps({**payload("gpt", 1), "alerts": []}).encode(), "alerts must hold 1 to 1000"),
    (json.dumps({**payload("gpt", 1), "alerts": [{"status": "firing"}]}).encode(), "alerts[0].labels must be"),
    (json.dumps({**payload("gpt", 1), "alerts": [{**payload("gpt", 1)["alerts"][0], "labels": {"job": 3}}]}).encode(),
     "alerts[0].labels.job must be a string"),
    (json.dumps({**payload("gpt", 1), "alerts": [{**payload("gpt", 1)["alerts"][0], "status": "x"}]}).encode(),
     "alerts[0].status must be firing or resolved"),
])
def test_malformed_payloads_name_the_field(body, message):
    with pytest.raises(PayloadError, match=None) as info:
        parse_payload(body)
    assert message in str(info.value), info.value


def test_configuration_errors_say_what_to_do(tmp_path):
    token = tmp_path / "token"
    with pytest.raises(ValueError, match="cannot read it"):
        WebhookConfig(listen="127.0.0.1:0", token_file=token)
    token.write_text("short\n")
    with pytest.raises(ValueError, match="use at least 16"):
        WebhookConfig(listen="127.0.0.1:0", token_file=token)
    token.write_text(TOKEN)
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        WebhookConfig(listen="9480", token_file=token)
    with pytest.raises(ValueError, match="go together"):
        WebhookConfig(listen="127.0.0.1:0", token_file=token, tls_cert=token)


# ---- the HTTP server ------------------------------------------------------------------------------------


def _serve(tmp_path: Path, control: FakeControl, **config) -> AlertmanagerWebhook:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    resumer = AlertResumer(control, node="n0", resumes_per_hour=3, clock=lambda: now[0])
    return AlertmanagerWebhook(WebhookConfig(listen="127.0.0.1:0", token_file=token, **config), resumer).start()


def _post(url: str, body: bytes, token: str | None = TOKEN, context=None, headers=None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, method="POST", headers=headers or {})
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_server_checks_path_token_size_and_payload_before_deciding(tmp_path, control):
    control.add("gpt", "failed")
    hook = _serve(tmp_path, control, max_body=4096)
    try:
        body = json.dumps(payload("gpt", 1)).encode()
        assert _post(hook.url.replace("/v1/alertmanager", "/other"), body)[0] == 404
        assert _post(hook.url, body, token=None)[0] == 401
        assert _post(hook.url, body, token="Bearer-ish")[0] == 401
        assert _post(hook.url, b"x" * 5000)[0] == 413
        code, reply = _post(hook.url, b"{}")
        assert code == 400 and 'version must be "4"' in reply["error"]
        assert not control.resumes  # nothing above reached a decision
        code, reply = _post(hook.url, body)
        assert code == 200 and reply["decisions"][0]["decision"] == "accepted"
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(hook.url, timeout=10)
        assert info.value.code == 405

        # a rotated token is read again; the old one stops working
        (tmp_path / "token").write_text("a-new-token-of-16-plus\n")
        assert _post(hook.url, body)[0] == 401
        assert _post(hook.url, body, token="a-new-token-of-16-plus")[1]["decisions"][0]["decision"] == "duplicate"

        control.fail_with = ConnectionError("etcd away")
        assert _post(hook.url, body, token="a-new-token-of-16-plus")[0] == 503  # Alertmanager retries
        metrics = {(m.name, tuple(s.labels.items()), s.value) for m in hook.collect() for s in m.samples}
        assert ("trainwarden_webhook_requests", (("code", "401"),), 3.0) in metrics
        assert ("trainwarden_webhook_decisions", (("decision", "accepted"),), 1.0) in metrics
    finally:
        hook.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_tls(tmp_path, control):
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", "key.pem", "-out", "cert.pem"],
                   cwd=tmp_path, check=True, capture_output=True)
    control.add("gpt", "failed")
    hook = _serve(tmp_path, control, tls_cert=tmp_path / "cert.pem", tls_key=tmp_path / "key.pem")
    try:
        assert hook.url.startswith("https://")
        context = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))
        code, reply = _post(hook.url, json.dumps(payload("gpt", 1)).encode(), context=context)
        assert code == 200 and reply["decisions"][0]["decision"] == "accepted"
        with pytest.raises(OSError):  # plain HTTP to a TLS port gets no answer
            _post(hook.url.replace("https://", "http://"), b"{}")
    finally:
        hook.stop()

"""The alert and recording rules (dashboards/prometheus/alerts.yml): promtool checks them and runs their unit
tests (alerts_test.yml), every alert says what and why and links to a runbook section that exists, and every
metric they use is one the agent exports, so renaming a metric in the code fails here."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from fake_nvml import gpu_node_exporter

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "dashboards" / "prometheus" / "alerts.yml"
PROMTOOL = shutil.which("promtool")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=RULES.parent,
                          start_new_session=True)


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


@needs_promtool
def test_promtool_accepts_the_rules_and_their_unit_tests_pass():
    check = _promtool("check", "rules", RULES.name)
    assert check.returncode == 0, check.stdout + check.stderr
    tested = _promtool("test", "rules", "alerts_test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_is_unit_tested_and_says_what_why_and_where_the_runbook_is():
    alerts = [r for r in _rules() if "alert" in r]
    tests = (RULES.parent / "alerts_test.yml").read_text()
    anchors = {"#" + re.sub(r"[^a-z0-9-]", "", line[3:].strip().lower().replace(" ", "-"))
               for line in (ROOT / "docs" / "OPERATIONS.md").read_text().splitlines() if line.startswith("## ")}
    assert len(alerts) >= 10
    for rule in alerts:
        notes = rule["annotations"]
        assert notes.get("summary") and notes.get("description"), rule["alert"]
        assert notes["runbook_url"] == f"docs/OPERATIONS.md#{rule['alert'].lower()}", rule["alert"]
        assert "#" + rule["alert"].lower() in anchors, f"no runbook section for {rule['alert']}"
        assert f"alertname: {rule['alert']}" in tests, f"{rule['alert']} has no promtool test"


def _exported_names() -> set[str]:
    """Metric names the agent exports: its GPU (fake NVML) and host collectors scraped over HTTP, and the
    family names spelled out in the code (job, watchdog, incident and etcd collectors)."""
    with gpu_node_exporter("n1") as (exporter, gpus, host):
        deadline = time.monotonic() + 20
        while not (gpus.samples and host.latest and sum(gpus.xid_counts().values())):
            assert time.monotonic() < deadline, "the samplers produced nothing"
            time.sleep(0.02)
        text = urllib.request.urlopen(exporter.url, timeout=5).read().decode()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("trainwarden_")}
    for path in (ROOT / "agent").rglob("*.py"):
        names.update(re.findall(r'Family\(\s*"(trainwarden_[a-z0-9_]+)"', path.read_text()))
    return names


def _base(name: str) -> str:
    return re.sub(r"_(total|bucket|sum|count|created)$", "", name)


def test_every_metric_the_rules_use_is_exported_by_the_agent():
    exported = {_base(n) for n in _exported_names()}
    used = set()
    for rule in _rules():
        used.update(re.findall(r"\b(trainwarden_[a-z0-9_]+)", rule["expr"]))
    used = {n for n in used if not n.startswith("trainwarden_:")}
    missing = sorted(n for n in used if _base(n) not in exported)
    assert not missing, f"the rules use metrics the agent does not export: {missing}"
    assert "trainwarden_gpu_xid_errors_total" in used and "trainwarden_worker_restarts_total" in used


def test_the_dashboards_are_generated_importable_and_use_only_exported_metrics():
    import json
    import sys

    build = subprocess.run([sys.executable, str(ROOT / "dashboards" / "grafana" / "build.py"), "--check"],
                           capture_output=True, text=True, timeout=60)
    assert build.returncode == 0, build.stderr  # job.json and node.json are what build.py writes
    exported = {_base(n) for n in _exported_names()}
    rules = {r["record"] for r in _rules() if "record" in r}
    for name in ("job.json", "node.json"):
        board = json.loads((ROOT / "dashboards" / "grafana" / name).read_text())
        variables = [v["name"] for v in board["templating"]["list"]]
        assert variables[0] == "datasource" and board["uid"].startswith("trainwarden-")
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)) and len(ids) >= 10
        exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
        exprs += [a["expr"] for a in board["annotations"]["list"]]
        for p in board["panels"]:
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        used = {n for e in exprs for n in re.findall(r"\b(trainwarden_[a-z0-9_]+)", e)}
        missing = sorted(n for n in used if _base(n) not in exported)
        assert not missing, f"{name} queries metrics the agent does not export: {missing}"
        recorded = {n for e in exprs for n in re.findall(r"\b(job[a-z_]*:[a-z0-9_:]+)", e)}
        assert recorded <= rules, f"{name} uses recording rules that alerts.yml lacks: {recorded - rules}"


@pytest.mark.skipif(shutil.which("amtool") is None, reason="amtool not installed (Debian prometheus-alertmanager)")
def test_the_alertmanager_example_routes_only_resume_alerts_to_the_webhook_and_operators_still_hear_them():
    config = str(ROOT / "deploy" / "alertmanager.yml")
    check = subprocess.run(["amtool", "check-config", config], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    failed = next(r for r in _rules() if r.get("alert") == "TrainwardenJobFailed")
    labels = [f"{k}={v}" for k, v in {"alertname": "TrainwardenJobFailed", "job": "gpt", "generation": "2",
                                      **failed["labels"]}.items()]

    def receivers(*labels: str) -> list[str]:
        out = subprocess.run(["amtool", "config", "routes", "test", f"--config.file={config}", *labels],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.strip().split(",")

    assert receivers(*labels) == ["trainwarden-resume", "operators"]
    assert receivers("alertname=TrainwardenStraggler", "job=gpt") == ["operators"]

"""A real Prometheus on loopback, as the integration test and the dashboard pictures run it: a scrape every
second of the given targets, trainwarden's rules loaded, ``honor_labels`` kept (the agent's ``job`` label is the
training job's), its data in a directory of the caller's."""

from __future__ import annotations

import json
import shutil
import urllib.parse
import urllib.request
from pathlib import Path

from procs import ProcessGroup

__all__ = ["RULES", "available", "query", "start_prometheus"]

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "dashboards" / "prometheus" / "alerts.yml"


def available() -> bool:
    return shutil.which("prometheus") is not None


def config(targets: list[str], *, scrape_interval_s: int = 1) -> str:
    return (f"global:\n  scrape_interval: {scrape_interval_s}s\n  evaluation_interval: {scrape_interval_s}s\n"
            f"rule_files: ['{RULES}']\n"
            "scrape_configs:\n  - job_name: trainwarden-agent\n    honor_labels: true\n"
            f"    static_configs:\n      - targets: {json.dumps(targets)}\n")


def start_prometheus(group: ProcessGroup, workdir: Path, targets: list[str], *, port: int,
                     scrape_interval_s: int = 1):
    """Start Prometheus on ``127.0.0.1:port`` in its own session through ``group`` (which stops it), with its
    configuration, data and log under ``workdir``. Returns the process; it may still be starting."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "prometheus.yml"
    path.write_text(config(targets, scrape_interval_s=scrape_interval_s))
    return group.spawn(["prometheus", f"--config.file={path}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                        f"--web.listen-address=127.0.0.1:{port}"], log=workdir / "prometheus.log")


def query(port: int, promql: str) -> list[dict]:
    """An instant query's result; raises AssertionError unless Prometheus answers "success"."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]["result"]

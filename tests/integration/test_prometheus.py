"""A real Prometheus scrapes the agent of `trainwarden run` while the 8-rank reference job trains, and an agent's
GPU and host collectors on a fake NVML; it loads trainwarden's rules, and every query of the Grafana dashboards
(dashboards/grafana/) must parse and return data from it."""

from __future__ import annotations

import json
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from local_prometheus import available, query, start_prometheus
from procs import wait_for
from trainwarden.agent.etcd.embedded import free_port

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT))
from dashboards import queries, render  # noqa: E402
from gpt_helpers import gpt_env  # noqa: E402

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not available(), reason="prometheus not installed (apt-get install prometheus)")]


@pytest.fixture
def gpu_node():
    """host:port of a node agent's GPU (fake NVML) and host collectors behind an exporter on loopback."""
    from fake_nvml import gpu_node_exporter

    with gpu_node_exporter("gpu-node", interval_s=0.5) as (exporter, _, _):
        yield exporter.url.split("//")[1].split("/")[0]


VARIABLES = {"job": "prom", "node": ".+", "__rate_interval": "10s", "__range": "5m"}
"""The dashboards' variables as Grafana would fill them for this job (10 s: ten scrapes)."""


def _grafana_queries() -> list[tuple[str, list[str]]]:
    """(where, [PromQL...]) per panel and annotation of the dashboards, variables filled in."""
    out = []
    for name in ("job.json", "node.json"):
        board = json.loads((ROOT / "dashboards" / "grafana" / name).read_text())
        out += [(f"{name}: {p['title']}", [queries.fill(t["expr"], VARIABLES) for t in p["targets"]])
                for p in board["panels"]]
        out += [(f"{name}: annotation {a['name']}", [queries.fill(a["expr"], VARIABLES)])
                for a in board["annotations"]["list"]]
    return out


@pytest.mark.timeout(300)
def test_prometheus_sees_every_rank_of_a_running_job(procs, tmp_path, gpu_node):
    metrics_port, prom_port = free_port(), free_port()
    start_prometheus(procs, tmp_path, [f"127.0.0.1:{metrics_port}", gpu_node], port=prom_port)
    started = time.time()

    env = gpt_env()
    env["TRAINWARDEN_STATE_HOME"] = str(tmp_path / "state")
    run = procs.spawn(
        [sys.executable, "-m", "trainwarden.agent.cli", "run", "--nproc-per-node", "8",
         "--metrics-port", str(metrics_port), "--job", "prom", "--model-params", "1e6", "--peak-tflops", "0.001",
         "--",
         "-m", "trainwarden.runtime.examples.gpt", "--dp", "2", "--tp", "2", "--pp", "2", "--steps", "300",
         "--ckpt-every", "10"],  # the checkpoint panels need one
        log=tmp_path / "run.log", env=env,
    )

    def ranks_reporting():
        if run.poll() is not None:
            raise AssertionError("the job ended early:\n" + (tmp_path / "run.log").read_text()[-3000:])
        try:
            return len(query(prom_port, 'trainwarden_last_step{job="prom"} > 15')) == 8
        except (OSError, ValueError, AssertionError):  # Prometheus still starting up
            return False

    wait_for(ranks_reporting, 180, interval=1.0, what="Prometheus to see 8 ranks past step 15")
    time.sleep(3)  # a few more scrapes for the rates

    step_time = query(prom_port, 'rate(trainwarden_step_duration_seconds_sum{job="prom"}[10s])'
                                 ' / rate(trainwarden_step_duration_seconds_count{job="prom"}[10s])')
    assert sorted(int(s["metric"]["rank"]) for s in step_time) == list(range(8))
    for series in step_time:
        assert 0.01 < float(series["value"][1]) < 10.0, series  # seconds per step: plausible, not absurd

    # collective summaries come from Flight Recorder reads, which are spaced out off the hot path
    def wait_series():
        found = query(prom_port, 'trainwarden_collective_wait_seconds_total{job="prom"}')
        return found if {int(s["metric"]["rank"]) for s in found} == set(range(8)) else None

    waits = wait_for(wait_series, 120, interval=1.0, what="collective wait series from all 8 ranks")
    ops = {s["metric"]["op"] for s in waits}
    assert {"all_reduce", "all_gather"} <= ops, ops  # tensor-parallel all-reduce, FSDP all-gather
    assert sum(float(s["value"][1]) for s in waits) > 0

    up = query(prom_port, 'sum(trainwarden_worker_up{job="prom"})')
    assert float(up[0]["value"][1]) == 8
    tokens = query(prom_port, 'sum(rate(trainwarden_tokens_total{job="prom"}[10s]))')
    assert float(tokens[0]["value"][1]) > 0

    # straggler scores: collective arrivals matched across the 8 ranks, scored within each pipeline stage
    def score_series():
        found = query(prom_port, 'trainwarden_straggler_score{job="prom"}')
        return found if {int(s["metric"]["rank"]) for s in found} == set(range(8)) else None

    scores = wait_for(score_series, 120, interval=1.0, what="straggler scores for all 8 ranks")
    assert all(0.5 < float(s["value"][1]) < 2.0 for s in scores), scores  # nobody slowed: all near 1
    flags = query(prom_port, 'trainwarden_straggler{job="prom"}')
    assert len(flags) == 8

    # `trainwarden top --job prom` finds this run's agent and its metrics endpoint from the records the
    # run keeps in the job's state directory
    record = tmp_path / "state" / "jobs" / "prom" / "agent.metrics.url"
    assert record.read_text().strip() == f"http://127.0.0.1:{metrics_port}/metrics"
    import subprocess
    top = subprocess.run([sys.executable, "-m", "trainwarden.agent.cli", "top", "--job", "prom", "--iterations", "1",
                          "--interval", "0.1", "--state-home", str(tmp_path / "state")],
                         capture_output=True, text=True, timeout=60, env={k: v for k, v in env.items()
                                                                           if k != "TRAINWARDEN_AGENT_SOCKET"})
    assert top.returncode == 0, top.stderr
    assert "prom" in top.stdout

    # every query of the Grafana dashboards parses (query() asserts Prometheus's "success"), and every panel
    # shows data: at least one of its queries returns some (a panel's incident query is empty on a clean run,
    # as are the annotations, which mark incidents and restarts); the variables' label_values find values
    time.sleep(2)  # the recording rules have been evaluated a few times
    empty = []
    for where, exprs in _grafana_queries():
        results = [query(prom_port, expr) for expr in exprs]
        if not any(results) and "annotation" not in where:
            empty.append(f"{where}: {exprs}")
    assert not empty, "panels without data:\n" + "\n".join(empty)
    for label, match in (("job", "trainwarden_last_step"), ("node", 'trainwarden_last_step{job="prom"}'),
                         ("node", "trainwarden_agent_info")):
        url = (f"http://127.0.0.1:{prom_port}/api/v1/label/{label}/values?"
               + urllib.parse.urlencode({"match[]": match}))
        with urllib.request.urlopen(url, timeout=5) as response:
            assert json.load(response)["data"], (label, match)

    # the dashboard pictures (dashboards/render.py) draw from this Prometheus: range queries over the run, the
    # variables resolved as Grafana would ($job: the first job Prometheus has, the only one), every panel drawn
    client = queries.PrometheusClient(f"http://127.0.0.1:{prom_port}")
    for name in ("job.json", "node.json"):
        board = json.loads((ROOT / "dashboards" / "grafana" / name).read_text())
        data = queries.collect(board, client, start=started, end=time.time(), step=1.0, scrape_interval_s=1,
                               rate_interval=VARIABLES["__rate_interval"])
        assert data.variables.get("job", "prom") == "prom", data.variables
        assert all(data.panels[p["id"]] for p in board["panels"]), name
        picture = render.save(render.draw(board, data), tmp_path / render.output_name(Path(name)))
        assert picture.stat().st_size > 20_000, picture

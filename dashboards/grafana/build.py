"""Generate the Grafana dashboards (job.json, node.json) from one description, so that panels, variables and
queries stay consistent.

    python dashboards/grafana/build.py           # write job.json and node.json next to this file
    python dashboards/grafana/build.py --check   # exit 1 if the files differ from what this would write

Both dashboards take a Prometheus datasource variable. The job dashboard has ``job`` and ``node`` variables;
the node dashboard has ``node``. Every query is tested against a real Prometheus that scraped a real CPU run
and a fake-NVML agent (tests/integration/test_prometheus.py), and every metric the queries use must be one
the agent exports.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${datasource}"}
JOB = 'job="$job", node=~"$node"'
NODE = 'node=~"$node"'


def _target(expr: str, legend: str, ref: str = "A", **extra) -> dict:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, **extra}


def _panel(pid: int, title: str, targets: list[dict], *, unit: str = "short", kind: str = "timeseries",
           x: int = 0, y: int = 0, w: int = 12, h: int = 8, description: str = "",
           thresholds: list[tuple[str, float | None]] | None = None, **extra) -> dict:
    """``thresholds``: (colour, from value) steps, the first from None (the base colour), as Grafana's."""
    defaults: dict = {"unit": unit}
    if thresholds:
        defaults["thresholds"] = {"mode": "absolute",
                                  "steps": [{"color": color, "value": value} for color, value in thresholds]}
    panel = {"id": pid, "type": kind, "title": title, "description": description, "datasource": DS,
             "gridPos": {"x": x, "y": y, "w": w, "h": h}, "targets": targets,
             "fieldConfig": {"defaults": defaults, "overrides": []}, "options": {}}
    return {**panel, **extra}


def _variable(name: str, query: str, *, label: str, multi: bool = False, include_all: bool = False) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": f"{name}-var"}, "definition": query, "refresh": 2,
            "multi": multi, "includeAll": include_all, "allValue": ".+" if include_all else None,
            "sort": 1, "current": {}, "options": []}


DATASOURCE_VARIABLE = {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
                       "current": {}, "options": [], "refresh": 1}


def _dashboard(uid: str, title: str, panels: list[dict], variables: list[dict], annotations: list[dict],
               description: str) -> dict:
    return {"uid": uid, "title": title, "description": description, "tags": ["trainwarden"], "timezone": "",
            "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s",
            "time": {"from": "now-1h", "to": "now"}, "panels": panels,
            "templating": {"list": [DATASOURCE_VARIABLE, *variables]},
            "annotations": {"list": annotations}}


NUMERIC_EVENTS = (
    "nan: a loss or gradient that was NaN or infinite; loss_spike: a loss far above its rolling median (both from "
    "the workers' numeric guard, runtime/numeric.py: under --numeric-policy rollback the step's update was skipped "
    "on every rank); sdc: silent data corruption, a rank whose recomputed gradient of a shared micro-batch differs "
    "bitwise from its replicas' (runtime/sdc_check.py, --sdc-every; drain a node named twice). Each numeric "
    "incident names the step and the first rank.")
"""What the numeric panels count, by kind (agent/shared/contract.py NUMERIC_KINDS)."""


def job_dashboard() -> dict:
    rate = "$__rate_interval"
    panels = [
        _panel(1, "Step time p50 per rank", [_target(
            f"histogram_quantile(0.5, sum by (node, rank, le) (rate(trainwarden_step_duration_seconds_bucket{{{JOB}}}[{rate}])))",
            "rank {{rank}} ({{node}})")], unit="s", x=0, y=0),
        _panel(2, "Step time p99 per rank", [_target(
            f"histogram_quantile(0.99, sum by (node, rank, le) (rate(trainwarden_step_duration_seconds_bucket{{{JOB}}}[{rate}])))",
            "rank {{rank}} ({{node}})")], unit="s", x=12, y=0),
        _panel(3, "Throughput", [_target(f"sum(rate(trainwarden_tokens_total{{{JOB}}}[{rate}]))", "tokens/s")],
               unit="short", x=0, y=8, description="Tokens per second, summed over the ranks."),
        _panel(4, "Collective wait share per rank", [_target(
            f"sum by (rank) (rate(trainwarden_collective_wait_seconds_total{{{JOB}}}[{rate}])) / "
            f"sum by (rank) (rate(trainwarden_step_seconds_total{{{JOB}}}[{rate}]))", "{{rank}}", format="heatmap")],
            unit="percentunit", kind="heatmap", x=12, y=8,
            options={"calculate": False, "yAxis": {"axisPlacement": "left"},
                     "color": {"mode": "scheme", "scheme": "Viridis", "scale": "linear", "steps": 64,
                               "min": 0, "max": 1}},
            description="Share of each rank's step time spent waiting in collectives (the rest is its own "
                        "compute). A straggler is the rank that waits least while the others wait for it."),
        _panel(5, "Straggler score per rank", [_target(f"trainwarden_straggler_score{{{JOB}}}",
                                                       "rank {{rank}} ({{node}})")], x=0, y=16,
               description="A rank's compute share over its peers' median: 1.0 is even; flagged above 1.15."),
        _panel(6, "Seconds since progress vs the hang deadline", [
            _target('job:trainwarden_seconds_since_progress:max{job="$job"}', "since progress"),
            _target('job:trainwarden_hang_timeout_seconds:max{job="$job"}', "hang deadline", ref="B")],
            unit="s", x=12, y=16),
        _panel(7, "Checkpoint age", [_target(f"max(trainwarden_checkpoint_age_seconds{{{JOB}}})", "age")],
               unit="s", x=0, y=24),
        _panel(8, "Checkpoint stall per rank", [_target(f"trainwarden_checkpoint_stall_seconds{{{JOB}}}",
                                                        "rank {{rank}}")], unit="s", x=12, y=24,
               description="How long the last checkpoint blocked the training step on each rank."),
        _panel(9, "Restarts and incidents", [
            _target(f"sum(increase(trainwarden_worker_restarts_total{{{JOB}}}[5m]))", "restarts (5m)"),
            _target(f"sum by (kind) (increase(trainwarden_incidents_total{{{JOB}}}[5m])) > 0", "{{kind}} (5m)",
                    ref="B")],
            x=0, y=32, description="Worker group restarts, and incidents by kind, in the last 5 minutes. Every kind "
                                   "is exported from 0; only those that occurred are drawn."),
        _panel(10, "Ranks connected", [_target(f"sum(trainwarden_worker_up{{{JOB}}})", "ranks up")], x=12, y=32),
        _panel(11, "Communication regression: step time / baseline", [
            _target(f"trainwarden_comm_regression_ratio{{{JOB}}}", "ratio ({{node}})"),
            _target(f"trainwarden_comm_regression{{{JOB}}}", "regressed ({{node}})", ref="B")],
            x=0, y=40, description="The job's step time over its own baseline, as each node's agent judges its "
                                   "ranks; 'regressed' is 1 while the extra time is collective wait on every rank "
                                   "with compute flat (a slower network, not more work)."),
        _panel(12, "Goodput: where the wall time went", [
            _target(f"max by (cause) (trainwarden_badput_seconds_total{{{JOB}}})", "{{cause}}"),
            _target(f"max(trainwarden_productive_seconds{{{JOB}}})", "productive (steps kept)", ref="B")],
            unit="s", x=12, y=40,
            fieldConfig={"defaults": {"unit": "s", "custom": {"stacking": {"mode": "normal"}, "fillOpacity": 40}},
                         "overrides": []},
            description="Since the job's first launch, as its launchers count it (agent/launch/goodput.py; kept "
                        "across launchers in etcd): the steps the job kept, and the rest by cause (startup, restore, "
                        "detection, hang, restart, steps redone, rendezvous, checkpoint stall, between steps, "
                        "straggler, communication regression, stopped, spare swap), stacked: the top is the wall "
                        "time. "
                        "trainwarden_goodput_ratio is the productive share; docs/OPERATIONS.md says what to do "
                        "about each cause."),
        _panel(13, "MFU: model FLOPs utilization", [_target(f"trainwarden_mfu_ratio{{{JOB}}}", "{{node}}")],
               unit="percentunit", x=0, y=48,
               description="The model's FLOPs per second over the accelerators' peak, per node (agent/launch/mfu.py): "
                           "only for a job run with --flops-per-step or --model-params, on GPUs the agent knows by "
                           "name or with --peak-tflops."),
        _panel(14, "Numeric events by kind: nan, loss_spike, sdc", [
            _target(f"sum by (kind) (increase(trainwarden_numeric_events_total{{{JOB}}}[5m]))", "{{kind}} (5m)")],
            x=12, y=48, description=NUMERIC_EVENTS),
        _panel(15, "Hot spares: waiting and swaps", [
            _target(f"sum(trainwarden_job_spare_nodes{{{JOB}}})", "spares waiting"),
            _target(f"sum by (cause) (increase(trainwarden_spare_swaps_total{{{JOB}}}[5m])) > 0",
                    "swaps: {{cause}} (5m)", ref="B")],
            x=0, y=56, w=14,
            description="With --spare-nodes: the nodes waiting in the job's rendezvous as hot spares, and the swaps "
                        "in the last 5 minutes by what the spare replaced (a lost node; an excluded one). A swap "
                        "keeps the world size; its recovery shows as 'spare swap' in the goodput panel. No spare "
                        "left: the next loss shrinks the job (--nnodes MIN:N) or waits for a node (N:N)."),
        _panel(16, "Numeric events in the time range", [
            _target(f"sum by (kind) (increase(trainwarden_numeric_events_total{{{JOB}}}[$__range]))", "{{kind}}")],
            kind="stat", x=14, y=56, w=10, thresholds=[("green", None), ("red", 1)],
            options={"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"},
            description="Each kind's count over the dashboard's time range, every kind shown (0: none; red from "
                        "1). " + NUMERIC_EVENTS),
    ]
    annotations = [
        {"name": "Incidents", "datasource": DS, "enable": True, "iconColor": "red",
         "expr": 'sum by (kind, node) (changes(trainwarden_incidents_total{job="$job"}[1m])) > 0',
         "titleFormat": "{{kind}}", "textFormat": "incident on {{node}}", "step": "60s"},
        {"name": "Restarts", "datasource": DS, "enable": True, "iconColor": "orange",
         "expr": 'sum by (node) (changes(trainwarden_worker_restarts_total{job="$job"}[1m])) > 0',
         "titleFormat": "restart", "textFormat": "worker group restarted on {{node}}", "step": "60s"},
    ]
    variables = [_variable("job", "label_values(trainwarden_last_step, job)", label="Job"),
                 _variable("node", 'label_values(trainwarden_last_step{job="$job"}, node)', label="Node",
                           multi=True, include_all=True)]
    return _dashboard("trainwarden-job", "trainwarden: job", panels, variables, annotations,
                      "One training job: step times, throughput, collective wait, stragglers, hangs, checkpoints.")


def node_dashboard() -> dict:
    rate = "$__rate_interval"
    gpu = "gpu {{gpu}} ({{node}})"
    panels = [
        _panel(1, "GPU utilization", [_target(f"trainwarden_gpu_utilization_ratio{{{NODE}}}", gpu)],
               unit="percentunit", x=0, y=0),
        _panel(2, "GPU memory used", [_target(f"trainwarden_gpu_memory_used_bytes{{{NODE}}}", gpu)],
               unit="bytes", x=12, y=0),
        _panel(3, "GPU temperature", [_target(f"trainwarden_gpu_temperature_celsius{{{NODE}}}", gpu)],
               unit="celsius", x=0, y=8),
        _panel(4, "GPU power", [_target(f"trainwarden_gpu_power_usage_watts{{{NODE}}}", gpu)], unit="watt",
               x=12, y=8),
        _panel(5, "Throttle reasons active", [_target(f"trainwarden_gpu_clock_event_active{{{NODE}}} == 1",
                                                      "gpu {{gpu}}: {{reason}}")], x=0, y=16),
        _panel(6, "ECC errors", [_target(f"increase(trainwarden_gpu_ecc_errors_total{{{NODE}}}[1h])",
                                         "gpu {{gpu}} {{type}}")], x=12, y=16),
        _panel(7, "XID errors", [_target(f"trainwarden_gpu_xid_errors_total{{{NODE}}}", "gpu {{gpu}} XID {{xid}}")],
               x=0, y=24, description="XIDs counted since the agent started, per GPU and XID. A series begins with "
                                      "its first XID, at 1 (so not as an increase() of the counter)."),
        _panel(8, "PCIe replays", [_target(f"rate(trainwarden_gpu_pcie_replays_total{{{NODE}}}[{rate}])", gpu)],
               x=12, y=24),
        _panel(9, "GPU healthy", [_target(f"trainwarden_gpu_healthy{{{NODE}}}", gpu)], kind="stat", x=0, y=32,
               description="0: a fatal XID, uncorrected ECC errors, a pending or failed row remap, or a lost GPU.",
               thresholds=[("red", None), ("green", 1)]),
        _panel(10, "Host CPU", [_target(f"trainwarden_host_cpu_utilization_ratio{{{NODE}}}", "{{node}}")],
               unit="percentunit", x=12, y=32),
        _panel(11, "Host memory used", [_target(f"trainwarden_host_memory_used_bytes{{{NODE}}}", "{{node}}")],
               unit="bytes", x=0, y=40),
        _panel(12, "Disk used", [_target(f"trainwarden_host_disk_used_bytes{{{NODE}}} / "
                                         f"trainwarden_host_disk_total_bytes{{{NODE}}}", "{{node}} {{mountpoint}}")],
               unit="percentunit", x=12, y=40),
        _panel(13, "Network", [
            _target(f"rate(trainwarden_host_network_receive_bytes_total{{{NODE}}}[{rate}])",
                    "{{node}} {{interface}} in"),
            _target(f"rate(trainwarden_host_network_transmit_bytes_total{{{NODE}}}[{rate}])",
                    "{{node}} {{interface}} out", ref="B")], unit="Bps", x=0, y=48),
    ]
    variables = [_variable("node", "label_values(trainwarden_agent_info, node)", label="Node", multi=True,
                           include_all=True)]
    return _dashboard("trainwarden-node", "trainwarden: node", panels, variables, [],
                      "One node: its GPUs (NVML) and its host.")


DASHBOARDS = {"job.json": job_dashboard, "node.json": node_dashboard}


def render(build) -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a file differs from what would be written")
    args = p.parse_args(argv)
    stale = []
    for name, build in DASHBOARDS.items():
        path, text = HERE / name, render(build)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python dashboards/grafana/build.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The dashboard pictures (dashboards/render.py, dashboards/queries.py) on canned Prometheus answers: variables
filled in as Grafana would, legends, annotations, and a PNG of the right size with every panel drawn."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from dashboards import queries, render, units  # noqa: E402

pytestmark = pytest.mark.timeout(60)

START, END, STEP = 1_800_000_000.0, 1_800_000_120.0, 2.0


def _board(name: str) -> dict:
    return json.loads((ROOT / "dashboards" / "grafana" / name).read_text())


class CannedPrometheus:
    """Answers ``query_range`` from (substring of the query -> result); every other query is empty."""

    def __init__(self, answers: dict[str, list[dict]], labels: dict[str, list[str]] | None = None) -> None:
        self.answers, self.labels, self.queries = answers, labels or {}, []

    def query_range(self, expr, start, end, step):
        self.queries.append(expr)
        return next((result for key, result in self.answers.items() if key in expr), [])

    def label_values(self, label, match, start, end):
        self.queries.append(f"label_values({match}, {label})")
        return self.labels.get(label, [])


def _matrix(labels: dict, fn, start=START, end=END, step=STEP) -> dict:
    times = [start + i * step for i in range(int((end - start) / step) + 1)]
    return {"metric": labels, "values": [[t, str(fn(t - start))] for t in times]}


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_fill_substitutes_every_form_and_refuses_an_unknown_variable():
    values = {"job": "prom", "node": ".+", "__rate_interval": "10s"}
    assert queries.fill('rate(x{job="$job", node=~"${node}"}[$__rate_interval])', values) == \
        'rate(x{job="prom", node=~".+"}[10s])'
    assert queries.fill('x{job="[[job]]"}', values) == 'x{job="prom"}'
    replace = 'label_replace(x, "a", "$1", "b", "(.*)")'
    assert queries.fill(replace, values) == replace
    with pytest.raises(KeyError, match=r"\$nodes"):
        queries.fill('x{node="$nodes"}', values)
    # every expression of both dashboards is filled completely
    for name in ("job.json", "node.json"):
        board = _board(name)
        exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
        exprs += [a["expr"] for a in board["annotations"]["list"]]
        for expr in exprs:
            assert "$" not in queries.fill(expr, {**values, **queries.builtin_values(step_s=2, range_s=60)})


def test_builtin_values_follow_grafana():
    assert queries.builtin_values(step_s=2, range_s=600, scrape_interval_s=15)["__rate_interval"] == "60s"
    assert queries.builtin_values(step_s=120, range_s=86400, scrape_interval_s=15)["__rate_interval"] == "135s"
    assert queries.builtin_values(step_s=2, range_s=60, rate_interval="10s")["__rate_interval"] == "10s"


def test_legend_formats():
    labels = {"__name__": "up", "rank": "3", "node": "n1"}
    assert queries.legend("rank {{rank}} ({{ node }})", labels) == "rank 3 (n1)"
    assert queries.legend("{{missing}} x", labels) == " x"
    assert queries.legend("", labels) == 'up{node="n1", rank="3"}'
    assert queries.legend(None, {}) == "{}"


def test_variables_resolve_as_grafana_opens_a_dashboard():
    board = _board("job.json")
    prom = CannedPrometheus({}, labels={"job": ["zeta", "alpha"]})
    values = queries.resolve_variables(board, {}, prom, START, END)
    assert values == {"datasource": "prometheus", "job": "alpha", "node": ".+"}  # first job; node's "All"
    assert queries.resolve_variables(board, {"job": "j", "node": "n1"}, prom, START, END)["node"] == "n1"
    with pytest.raises(ValueError, match="no variable nodes"):
        queries.resolve_variables(board, {"nodes": "x"}, prom, START, END)
    with pytest.raises(ValueError, match=r"\$job.*found no value"):
        queries.resolve_variables(board, {}, CannedPrometheus({}), START, END)


def test_annotations_mark_where_each_run_of_samples_begins_and_where_it_counts_one_more():
    result = [{"metric": {"kind": "crash", "node": "n1"},
               "values": [[START + t, v] for t, v in ((10, "1"), (12, "1"), (14, "2"), (16, "2"), (60, "1"),
                                                      (62, "1"))]}]
    spec = {"titleFormat": "{{kind}}", "textFormat": "incident on {{node}}", "iconColor": "red"}
    marks = queries._annotations(result, spec, step=2.0)
    assert [(m.time - START, m.title, m.text) for m in marks] == [(10, "crash", "incident on n1"),
                                                                  (14, "crash", "incident on n1"),
                                                                  (60, "crash", "incident on n1")]


def _job_answers() -> dict[str, list[dict]]:
    ranks = [{"rank": str(r), "node": "n0"} for r in range(8)]
    return {
        "histogram_quantile(0.5": [_matrix(m, lambda t, r=int(m["rank"]): 0.3 + 0.01 * r) for m in ranks],
        "trainwarden_tokens_total": [_matrix({}, lambda t: 4000 + 100 * math.sin(t / 10))],
        "collective_wait": [_matrix({"rank": m["rank"]}, lambda t, r=int(m["rank"]): 0.2 + 0.05 * r)
                            for m in ranks],
        "trainwarden_straggler_score": [_matrix(m, lambda t: 1.0) for m in ranks],
        "trainwarden_incidents_total{job=\"prom\"}[1m])) > 0": [
            {"metric": {"kind": "crash", "node": "n0"}, "values": [[START + 40, "1"], [START + 42, "1"]]}],
    }


def test_a_dashboard_picture_from_canned_answers(tmp_path):
    board = _board("job.json")
    prom = CannedPrometheus(_job_answers())
    data = queries.collect(board, prom, start=START, end=END, step=STEP, variables={"job": "prom"})
    assert all('"$' not in q and "$__" not in q for q in prom.queries)
    assert len(data.panels[1]) == 8 and data.panels[1][0].name == "rank 0 (n0)"
    assert [(a.title, a.time) for a in data.annotations] == [("crash", START + 40)]

    layout = render.Layout(width_px=1200, row_px=30, header_px=60, dpi=100)
    fig = render.draw(board, data, layout)
    heatmap = [image for ax in fig.axes for image in ax.get_images()]
    assert [image.get_array().shape for image in heatmap] == [(8, 61)]  # a row per rank, a column per step
    texts = [t.get_text() for t in fig.texts]
    titles = [p["title"] for p in board["panels"]]
    assert all(title in texts for title in titles)
    # panels without canned data say so: checkpoint age and stall, restarts, ranks connected, p99, hang deadline,
    # communication regression, goodput, MFU, numeric events (over time and in the range), hot spares
    assert texts.count("No data") == 12, texts
    path = render.save(fig, tmp_path / "dashboard-job.png")
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in board["panels"])
    assert _png_size(path) == (1200, 60 + rows * 30 + layout.gap_px)
    assert 10_000 < path.stat().st_size < 400_000


def test_the_job_dashboard_shows_numeric_events_by_every_kind_the_agent_counts():
    """Issue 48: NaN/Inf (nan), loss spikes and silent data corruption (sdc) each counted over time and over the
    dashboard's range, every kind shown (0 included: the agent exports each from 0) and red once one occurred; each
    kind the contract names is one the panels explain."""
    from trainwarden.agent.shared.contract import NUMERIC_KINDS

    board = _board("job.json")
    numeric = [p for p in board["panels"] if any("trainwarden_numeric_events_total" in t["expr"]
                                                 and "by (kind)" in t["expr"] for t in p["targets"])]
    stat = [p for p in numeric if p["type"] == "stat"]
    assert len(numeric) == 2 and len(stat) == 1, [p["title"] for p in numeric]
    assert "[$__range]" in stat[0]["targets"][0]["expr"]
    for panel in numeric:
        assert all(f"{kind}:" in panel["description"] for kind in NUMERIC_KINDS), panel["title"]

    answers = {"trainwarden_numeric_events_total": [
        _matrix({"kind": kind}, lambda t, kind=kind: 1 if kind == "sdc" and t >= 60 else 0) for kind in NUMERIC_KINDS]}
    data = queries.collect(board, CannedPrometheus(answers), start=START, end=END, step=STEP,
                           variables={"job": "prom"})
    fig = render.draw(board, data)
    big = sorted((t.get_text(), t.get_color()) for t in fig.texts
                 if t.get_fontweight() == "bold" and t.get_fontsize() > 20)
    green, red = units.THRESHOLD_COLORS["green"], units.THRESHOLD_COLORS["red"]
    assert big == [("0", green)] * (len(NUMERIC_KINDS) - 1) + [("1", red)], big
    assert set(NUMERIC_KINDS) <= {t.get_text() for t in fig.texts}  # each cell's name


def test_stat_panels_show_the_last_value_coloured_by_the_panel_thresholds(tmp_path):
    board = _board("node.json")
    answers = {"trainwarden_gpu_healthy": [_matrix({"gpu": "0", "node": "g"}, lambda t: 1),
                                           _matrix({"gpu": "1", "node": "g"}, lambda t: 1 if t < 60 else 0)]}
    data = queries.collect(board, CannedPrometheus(answers), start=START, end=END, step=STEP)
    fig = render.draw(board, data)
    big = {t.get_text(): t.get_color() for t in fig.texts if t.get_fontweight() == "bold" and t.get_fontsize() > 20}
    assert big == {"1": units.THRESHOLD_COLORS["green"], "0": units.THRESHOLD_COLORS["red"]}
    path = render.save(fig, tmp_path / "node.png")
    assert _png_size(path)[0] == 1600


def test_values_are_shown_in_the_panel_unit():
    assert units.format_value(0.25, "percentunit") == "25%"
    assert units.format_value(0.0123, "s") == "12.3 ms"
    assert units.format_value(3 * 2**30, "bytes") == "3 GiB"
    assert units.format_value(2048, "Bps") == "2 KiB/s"
    assert units.format_value(250, "watt") == "250 W"
    assert units.format_value(71, "celsius") == "71 °C"
    assert units.format_value(4200, "short") == "4.2k"
    assert units.format_value(1.5 * 2**30, "bytes") == "1.5 GiB"
    assert units.format_value(90, "s") == "90 s"
    assert units.format_value(900, "s") == "15 min"
    assert units.format_value(0.015, "percentunit") == "1.5%"
    assert units.format_value(float("nan"), "s") == "–"


def test_the_command_line_names_its_pictures_and_rejects_a_bad_range(tmp_path, capsys):
    assert render.output_name(Path("dashboards/grafana/node.json")) == "dashboard-node.png"
    assert render.parse_time("now-15m", 1000.0) == render.parse_time("-15m", 1000.0) == 100.0
    assert render.parse_time("2027-01-15T10:00:00", 0) == 1800007200.0
    with pytest.raises(SystemExit):
        render.main(["--start", "now", "--end", "now-1m", str(ROOT / "dashboards" / "grafana" / "job.json")])
    assert "must be after" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # job.json has $job, node.json has not: fine; $jobs is in neither
        render.main(["--var", "job=a", "--var", "jobs=b", str(ROOT / "dashboards" / "grafana" / "job.json"),
                     str(ROOT / "dashboards" / "grafana" / "node.json")])
    assert "no dashboard given has the variable jobs" in capsys.readouterr().err

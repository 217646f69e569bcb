"""The post-mortem page of `trainwarden report`: one self-contained HTML file that opens offline.

``render`` draws a ``ReportData`` (data.py) with plotly, whose JavaScript is embedded in the page (never a CDN):
a header (the job, its time span, runs, restarts, final phase, goodput); step time per rank over wall time with
the rounds, failures, incidents and committed checkpoints on the same time axis (a lane under the steps, and a
vertical line at each round's start and failure); the goodput breakdown as a stacked bar and a table; the
incidents and the checkpoints as tables. plotly is imported only here, when a page is drawn, so the agent runs
without it; without it the error says which extra to install.
"""

from __future__ import annotations

import datetime
import html
import os
from pathlib import Path

import numpy as np

from trainwarden.agent import __version__
from trainwarden.agent.shared.atomic_file import atomic_write
from trainwarden.agent.report.data import ReportData, ReportError, StepSeries, cause_label, gather

__all__ = ["build_report", "render", "write_report"]

SCATTERGL_POINTS = 20_000
"""Past this many points the step chart draws with WebGL (``Scattergl``)."""
_EVENT_STYLE = {  # event -> (lane marker, colour, vertical line dash or None)
    "launched": ("triangle-right", "#1f77b4", None),
    "round_started": ("line-ns-open", "grey", "dot"),
    "round_failed": ("x", "red", "solid"),
    "restarting": ("circle-open", "orange", None),
    "ended": ("square", "black", None),
}
_LANES = ["checkpoints", "incidents", "rounds"]
_STYLE = """body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
td.n{text-align:right}.note{color:#8a5300}dl{display:grid;grid-template-columns:max-content auto;gap:.2em 1em}
dt{font-weight:600}dd{margin:0}"""


def build_report(job: str, state_home: str | os.PathLike | None = None) -> str:
    """The report of ``job`` as one HTML page (``ReportError`` with what to do when it cannot be made)."""
    return render(gather(job, state_home))


def write_report(data: ReportData, out: str | os.PathLike | None = None) -> Path:
    """Draw ``data`` and write the page to ``out`` (default ``<state dir>/report.html``); the path written."""
    page = render(data)
    path = Path(out) if out is not None else data.state_dir / "report.html"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, page.encode())
    except OSError as exc:
        raise ReportError(f"cannot write the report to {path}: {exc} (give another file with --out)") from None
    return path


def render(data: ReportData) -> str:
    go, make_subplots = _plotly()
    charts = [_timeline(go, make_subplots, data)]
    goodput = _goodput_figure(go, data.history.goodput)
    if goodput is not None:
        charts.append(goodput)
    divs = [fig.to_html(full_html=False, include_plotlyjs=(i == 0), config={"displaylogo": False})
            for i, fig in enumerate(charts)]
    body = [f"<h1>Job {_e(data.job)}</h1>", _header(data), *_notes(data),
            f"<h2>Step time {'per rank' if data.per_rank else 'across ranks'}</h2>", divs[0],
            "<h2>Goodput</h2>", *(divs[1:] or ["<p>No goodput was recorded.</p>"]), _goodput_table(data.history.goodput),
            "<h2>Incidents</h2>", _incident_table(data), "<h2>Checkpoints</h2>", _checkpoint_table(data)]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>trainwarden report: {_e(data.job)}</title><style>{_STYLE}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def _plotly():
    try:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
    except ImportError:
        raise ReportError("the report draws its charts with plotly, a dependency of trainwarden that is missing "
                          "here: pip install 'plotly>=5.20' (or reinstall trainwarden)") from None
    return go, make_subplots


def _e(value) -> str:
    return html.escape(str(value))


def _when(t: float | None) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def _x(times) -> list[str | None]:
    """Unix times as the chart's x values: local time, None where a line breaks (NaN)."""
    return [datetime.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="milliseconds") if t == t else None
            for t in np.asarray(times, dtype=np.float64).tolist()]


def _header(data: ReportData) -> str:
    span = data.span()
    ended = data.events("ended")
    goodput = data.history.goodput or {}
    ratio = goodput.get("ratio")
    zone = datetime.datetime.now().astimezone().strftime("UTC%z")
    items = [
        ("time span", f"{_when(span[0])} to {_when(span[1])} ({span[1] - span[0]:.0f} s; times are local: {zone})"
         if span else "-"),
        ("runs", len(data.events("launched"))),
        ("restarts", len(data.events("round_failed"))),
        ("final phase", ended[-1].get("phase", "?") if ended else "no end recorded (running, or killed)"),
        ("goodput", f"{ratio:.1%} of {goodput.get('wall_s', 0):.0f} s" if isinstance(ratio, (int, float)) else "-"),
        ("ranks", data.ranks),
        ("state directory", data.state_dir),
        ("generated", f"{_when(datetime.datetime.now().timestamp())} by trainwarden {__version__}"),
    ]
    return "<dl>" + "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in items) + "</dl>"


def _notes(data: ReportData) -> list[str]:
    notes = []
    if data.history.skipped_lines:
        notes.append(f"{data.history.skipped_lines} line(s) of the history could not be read and were skipped "
                     "(a run killed while writing one).")
    if not data.rows:
        notes.append("No step was recorded: the job never finished a step.")
    if not data.per_rank:
        notes.append(f"{data.ranks} ranks: the chart shows the minimum, median and maximum step time across ranks "
                     "per step, not one line per rank.")
    if data.downsampled:
        notes.append(f"The chart shows {data.shown:,} of {data.rows:,} step times: each line keeps the fastest and "
                     "the slowest step of each stretch of steps.")
    return [f'<p class="note">{_e(n)}</p>' for n in notes]


def _timeline(go, make_subplots, data: ReportData):
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.8, 0.2], vertical_spacing=0.03)
    scatter = go.Scattergl if data.shown > SCATTERGL_POINTS else go.Scatter
    for series in data.series:
        fig.add_trace(_step_trace(scatter, series, data.shown), row=1, col=1)
    for name, (symbol, colour, dash) in _EVENT_STYLE.items():
        events = data.events(name)
        if not events:
            continue
        fig.add_trace(go.Scatter(
            x=_x([e["t"] for e in events]), y=["rounds"] * len(events), mode="markers", name=name.replace("_", " "),
            marker={"symbol": symbol, "color": colour, "size": 11, "line": {"width": 2, "color": colour}},
            hovertext=[_event_text(e) for e in events], hoverinfo="text+x"), row=2, col=1)
        if dash:
            for e in events:
                fig.add_shape(type="line", xref="x", yref="paper", x0=_x([e["t"]])[0], x1=_x([e["t"]])[0], y0=0,
                              y1=1, line={"color": colour, "dash": dash, "width": 1})
    if data.incidents:
        fig.add_trace(go.Scatter(
            x=_x([i.detected_at for i in data.incidents]), y=["incidents"] * len(data.incidents), mode="markers",
            name="incident", marker={"symbol": "diamond", "size": 11, "color": "#d62728"},
            hovertext=[_incident_text(i) for i in data.incidents], hoverinfo="text+x"), row=2, col=1)
    committed = [c for c in data.checkpoints if c.state.startswith("complete") and c.time]
    if committed:
        fig.add_trace(go.Scatter(
            x=_x([c.time for c in committed]), y=["checkpoints"] * len(committed), mode="markers",
            name="checkpoint", marker={"symbol": "square", "size": 9, "color": "#2ca02c"},
            hovertext=[f"checkpoint step {c.step} ({c.state}, {_size(c.bytes)})" for c in committed],
            hoverinfo="text+x"), row=2, col=1)
    fig.update_yaxes(title_text="step time (s)", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(categoryorder="array", categoryarray=_LANES, range=[-0.5, len(_LANES) - 0.5], row=2, col=1)
    fig.update_xaxes(title_text="wall time (local)", row=2, col=1)
    fig.update_layout(height=620, margin={"t": 30, "b": 40}, hovermode="closest", template="plotly_white")
    if not data.series:
        fig.add_annotation(text="no step recorded", xref="x domain", yref="y domain", x=0.5, y=0.5,
                           showarrow=False, row=1, col=1)
    return fig


def _step_trace(scatter, series: StepSeries, points: int):
    return scatter(
        x=_x(series.end), y=series.duration, customdata=series.step, name=series.name,
        mode="lines" if points > 2_000 else "lines+markers", marker={"size": 4}, line={"width": 1},
        hovertemplate=f"{_e(series.name)}<br>step %{{customdata:.0f}}<br>%{{y:.3f}} s<br>%{{x}}<extra></extra>")


def _event_text(event: dict) -> str:
    name = event.get("event", "?")
    if name == "round_failed":
        failures = event.get("failures") or []
        detail = ", ".join(f"rank {f.get('rank')} exit {f.get('exitcode')}" for f in failures[:8]
                           if isinstance(f, dict))
        return f"round failed: {_e(detail or 'no failure detail')}"
    if name == "round_started":
        return f"round {_e(event.get('round', '?'))} started ({_e(event.get('workers', '?'))} workers)"
    if name == "launched":
        return f"launched on {_e(event.get('node', '?'))} (pid {_e(event.get('pid', '?'))})"
    if name == "ended":
        return f"ended: {_e(event.get('phase', '?'))} (exit {_e(event.get('exit_code', '?'))})"
    return f"{_e(name)}: {_e(event.get('reason', ''))}"


def _incident_text(incident) -> str:
    summary = str(dict(incident.evidence).get("summary") or "")
    lines = [f"<b>{_e(incident.kind.value)}</b> ({_e(incident.state.value)})",
             f"ranks {_e(','.join(map(str, incident.ranks)) or '-')} on {_e(incident.node)}",
             f"action: {_e(incident.action or '-')}", _e(_clip(summary, 160))]
    return "<br>".join(line for line in lines if line)


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _goodput_parts(goodput: dict | None) -> list[tuple[str, float]]:
    """(label, seconds): productive first, then each cause of badput, largest first."""
    if not goodput:
        return []
    causes = goodput.get("badput_s") or {}
    parts = [("productive", float(goodput.get("productive_s") or 0))]
    parts += sorted(((cause_label(c), float(s or 0)) for c, s in causes.items()), key=lambda p: -p[1])
    return parts


def _goodput_figure(go, goodput: dict | None):
    parts = [p for p in _goodput_parts(goodput) if p[1] > 0]
    if not parts:
        return None
    total = sum(s for _, s in parts)
    fig = go.Figure()
    for label, seconds in parts:
        fig.add_trace(go.Bar(
            x=[seconds], y=["wall time"], orientation="h", name=label, text=[f"{seconds / total:.0%}"],
            textposition="inside", marker={"color": "#2ca02c"} if label == "productive" else None,
            hovertemplate=f"{_e(label)}: %{{x:.1f}} s ({seconds / total:.1%})<extra></extra>"))
    fig.update_layout(barmode="stack", height=200, margin={"t": 20, "b": 40}, xaxis_title="seconds",
                      template="plotly_white", legend={"orientation": "h", "y": -0.5, "traceorder": "normal"})
    return fig


def _goodput_table(goodput: dict | None) -> str:
    parts = _goodput_parts(goodput)
    if not parts:
        return ""
    wall = float(goodput.get("wall_s") or 0) or sum(s for _, s in parts)
    rows = "".join(f"<tr><td>{_e(label)}</td><td class=n>{seconds:.1f}</td><td class=n>{seconds / wall:.1%}</td></tr>"
                   for label, seconds in parts)
    return (f"<table><tr><th>where the time went</th><th>seconds</th><th>share</th></tr>{rows}"
            f"<tr><th>wall time</th><th class=n>{wall:.1f}</th><th class=n>100%</th></tr></table>")


def _incident_table(data: ReportData) -> str:
    if not data.incidents:
        return "<p>No incident was recorded.</p>"
    rows = "".join(
        f"<tr><td>{_e(_when(i.detected_at))}</td><td>{_e(i.kind.value)}</td><td>{_e(i.state.value)}</td>"
        f"<td>{_e(','.join(map(str, i.ranks)) or '-')}</td><td>{_e(i.node)}</td><td>{_e(i.action or '-')}</td>"
        f"<td>{_e(_clip(i.outcome or '-', 200))}</td><td>{_e(i.id)}</td></tr>" for i in data.incidents)
    return ("<table><tr><th>detected</th><th>kind</th><th>state</th><th>ranks</th><th>node</th><th>action</th>"
            f"<th>outcome</th><th>id (trainwarden incidents show ID)</th></tr>{rows}</table>")


def _checkpoint_table(data: ReportData) -> str:
    if not data.checkpoints:
        return f"<p>No checkpoint in {_e(data.checkpoint_dir)}.</p>"
    rows = "".join(
        f"<tr><td class=n>{c.step}</td><td>{_e(c.state)}</td><td class=n>{_e(_size(c.bytes))}</td>"
        f"<td>{_e(_when(c.time))}</td><td>{_e(_clip(c.detail, 300))}</td></tr>" for c in data.checkpoints)
    return (f"<p>{_e(data.checkpoint_dir)}</p><table><tr><th>step</th><th>state</th><th>size</th><th>time</th>"
            f"<th>detail</th></tr>{rows}</table>")


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"

"""A picture of a Grafana dashboard drawn from Prometheus data, with matplotlib, where no Grafana server is.

    python -m dashboards.render --prometheus http://127.0.0.1:9090 --start now-15m --var job=gpt-small \\
        --out docs/img dashboards/grafana/job.json dashboards/grafana/node.json

writes ``dashboard-job.png`` and ``dashboard-node.png``. Panels sit where their ``gridPos`` puts them on
Grafana's 24-column grid; time series are lines (named by ``legendFormat``), heatmaps an image with one row per
series, stat panels big numbers (coloured by the panel's thresholds), annotations vertical lines on every time
axis and listed with their times under the title. A panel whose queries returned nothing says "No data".

``draw(board, data)`` is pure: a dashboard and ``queries.DashboardData`` in, a matplotlib ``Figure`` out (Agg,
no display, no pyplot state), so tests draw canned data; values read as in the panel's unit (``units``).
``render`` runs the queries (``queries.collect``) and saves the picture. ``tests/dashboard_pictures.py`` (``make
dashboard-pictures``) makes the pictures in docs/OPERATIONS.md from a real run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

if __package__ in (None, ""):  # run as a script: python dashboards/render.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dashboards.queries import DashboardData, PrometheusClient, QueryError, Series, collect  # noqa: E402
from dashboards.units import format_value, locator, threshold_color  # noqa: E402

__all__ = ["Layout", "draw", "main", "output_name", "parse_time", "render", "save"]

GRID_COLUMNS = 24
"""Grafana's grid: a panel's gridPos x and w count these columns."""

PALETTE = ["#7EB26D", "#EAB839", "#6ED0E0", "#EF843C", "#E24D42", "#1F78C1", "#BA43A9", "#705DA0", "#508642",
           "#CCA300", "#447EBC", "#C15C17", "#890F02", "#0A437C", "#6D1F62", "#584477"]
"""Grafana's classic series colours, in its order."""

BACKGROUND, PANEL, BORDER, TEXT, MUTED, GRID = "#111217", "#181b1f", "#2c3235", "#d8d9da", "#8e8e8e", "#2a2d31"


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The picture's geometry, in pixels."""

    width_px: int = 1600
    """Width of the whole picture; the 24 grid columns share it."""
    row_px: int = 32
    """Height of one gridPos row (Grafana's is 30 px plus a margin)."""
    header_px: int = 64
    """Title, time range, variables and annotations above the panels."""
    gap_px: int = 8
    """Space between panels."""
    dpi: int = 100
    """Pixels per inch of the saved PNG (font sizes are in points)."""

    def __post_init__(self) -> None:
        for name in ("width_px", "row_px", "dpi"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Layout.{name} must be positive, got {getattr(self, name)}")


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


# ---- drawing -----------------------------------------------------------------------------------------------

class _Canvas:
    """Pixel coordinates from the top left of the picture, turned into the figure's fractions."""

    def __init__(self, fig: Figure, width: float, height: float) -> None:
        self.fig, self.width, self.height = fig, width, height

    def rect(self, left: float, top: float, w: float, h: float) -> list[float]:
        return [left / self.width, 1 - (top + h) / self.height, w / self.width, h / self.height]

    def point(self, x: float, y: float) -> tuple[float, float]:
        return x / self.width, 1 - y / self.height

    def width_of(self, text) -> float:
        """A drawn text's width in pixels."""
        return text.get_window_extent(self.fig.canvas.get_renderer()).width

    def axes(self, left: float, top: float, w: float, h: float):
        ax = self.fig.add_axes(self.rect(left, top, max(w, 1), max(h, 1)))
        ax.set_facecolor(PANEL)
        for spine in ax.spines.values():
            spine.set_color(BORDER)
        ax.tick_params(colors=MUTED, labelsize=8, length=3)
        return ax


def _dates(times) -> np.ndarray:
    return (np.asarray(times, dtype="float64") * 1000).astype("datetime64[ms]")


def _time_axis(ax, data: DashboardData) -> None:
    ax.set_xlim(_dates([data.start])[0], _dates([data.end])[0])
    ax.xaxis.set_major_locator(mdates.AutoDateLocator(minticks=3, maxticks=7))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S", tz=dt.timezone.utc))


def _annotate(ax, data: DashboardData, *, labels: bool = False) -> None:
    """The annotations as dashed vertical lines; ``labels``: each with its title along it (the top row)."""
    for a in data.annotations:
        when = _dates([a.time])[0]
        ax.axvline(when, color=a.color, linewidth=1.2, linestyle=(0, (4, 2)), alpha=0.9, zorder=1)
        if labels:
            ax.text(when, 0.97, f" {a.title}", transform=ax.get_xaxis_transform(), rotation=90, ha="right",
                    va="top", fontsize=7, color=TEXT, alpha=0.9, clip_on=True)


def _legend(canvas: _Canvas, series: list[Series], colors: list[str], left: float, top: float, width: float,
            max_rows: int) -> None:
    names = [s.name for s in series]
    ncol = _legend_columns(names, width)
    shown = len(names) if len(names) <= ncol * max_rows else ncol * max_rows - 1
    handles = [Line2D([], [], color=c, linewidth=2) for c in colors[:shown]]
    labels = names[:shown]
    if shown < len(names):
        handles.append(Line2D([], [], color=PANEL))
        labels.append(f"+{len(names) - shown} more")
    rows = math.ceil(len(labels) / ncol)
    ncol = math.ceil(len(labels) / rows)  # as few columns as the rows need: full rows but the last
    # matplotlib fills a legend column by column; Grafana's reads row by row
    order = [r * ncol + c for c in range(ncol) for r in range(rows) if r * ncol + c < len(labels)]
    handles, labels = [handles[i] for i in order], [labels[i] for i in order]
    canvas.fig.legend(handles, labels, loc="upper left", bbox_to_anchor=canvas.point(left, top), ncol=ncol,
                      frameon=False, fontsize=8, labelcolor=TEXT, handlelength=1.4, columnspacing=1.2,
                      borderaxespad=0, borderpad=0, handletextpad=0.5, labelspacing=0.25)


def _legend_columns(names: list[str], width: float) -> int:
    entry_px = min(width, 30 + 6.2 * max(len(n) for n in names))
    return max(1, int(width // entry_px))


def _legend_rows(series: list[Series], width: float, max_rows: int) -> int:
    return min(max_rows, math.ceil(len(series) / _legend_columns([s.name for s in series], width)))


def _timeseries(canvas: _Canvas, panel: dict, series: list[Series], data: DashboardData, box) -> None:
    left, top, w, h = box
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
    max_rows = 2 if h < 260 else 3
    rows = _legend_rows(series, w - 70, max_rows)
    legend_px = rows * 15 + 4
    ax = canvas.axes(left + 62, top + 8, w - 72, h - 30 - legend_px)
    colors = [PALETTE[i % len(PALETTE)] for i in range(len(series))]
    for s, color in zip(series, colors):
        values = np.asarray(s.values, dtype="float64")
        values[~np.isfinite(values)] = np.nan  # +Inf (a histogram_quantile past the last bucket): a gap
        ax.plot(_dates(s.times), values, color=color, linewidth=1.3, zorder=2)
    _annotate(ax, data, labels=panel["gridPos"]["y"] == 0)
    _time_axis(ax, data)
    ax.yaxis.set_major_locator(locator(unit))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_value(v, unit)))
    ax.grid(True, color=GRID, linewidth=0.6)
    finite = [v for s in series for v in s.values if math.isfinite(v)]
    if finite and min(finite) >= 0:  # from 0, with room above the highest point; a flat 0 gets 0 to 1
        ax.set_ylim(0, max(finite) * 1.1 or 1)
    _legend(canvas, series, colors, left + 62, top + h - legend_px + 2, w - 70, max_rows)


def _heatmap(canvas: _Canvas, panel: dict, series: list[Series], data: DashboardData, box) -> None:
    """One row per series (sorted by name, numbers numerically), one column per step, colour = value on the
    panel's colour scale (``options.color``: scheme, min, max; else the data's range)."""
    left, top, w, h = box
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
    series = sorted(series, key=lambda s: _natural(s.name))
    times = sorted({t for s in series for t in s.times})
    column = {t: i for i, t in enumerate(times)}
    grid = np.full((len(series), len(times)), np.nan)
    for row, s in enumerate(series):
        for t, v in zip(s.times, s.values):
            grid[row, column[t]] = v
    step = (times[-1] - times[0]) / max(1, len(times) - 1) if len(times) > 1 else 1.0
    x0, x1 = mdates.date2num(_dates([times[0] - step / 2, times[-1] + step / 2]))
    ax = canvas.axes(left + 62, top + 8, w - 140, h - 34)
    color = panel.get("options", {}).get("color", {})
    finite = grid[np.isfinite(grid)]
    vmin = color.get("min", float(finite.min()) if finite.size else 0.0)
    vmax = color.get("max", float(finite.max()) if finite.size else 1.0)
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", origin="lower", cmap=_colormap(color),
                      extent=[x0, x1, -0.5, len(series) - 0.5], vmin=vmin, vmax=max(vmax, vmin + 1e-9))
    ax.xaxis_date()
    _annotate(ax, data)
    _time_axis(ax, data)
    ax.set_yticks(range(len(series)), [s.name for s in series])
    ax.set_ylabel(panel["targets"][0].get("legendFormat", "").strip("{} ") or "series", color=MUTED, fontsize=8)
    bar_ax = canvas.axes(left + w - 66, top + 8, 10, h - 34)
    bar = canvas.fig.colorbar(image, cax=bar_ax, format=FuncFormatter(lambda v, _: format_value(v, unit)))
    bar.outline.set_edgecolor(BORDER)
    bar_ax.tick_params(colors=MUTED, labelsize=8)


def _colormap(color: dict) -> str:
    """The matplotlib colour map of a heatmap's ``options.color.scheme`` (Grafana's d3 names), else viridis."""
    scheme = color.get("scheme", "")
    for name in (scheme, scheme.lower()):
        if name and name in matplotlib.colormaps:
            return name + ("_r" if color.get("reverse") else "")
    return "viridis"


def _stat(canvas: _Canvas, panel: dict, series: list[Series], box) -> None:
    """Each series' last value, big, in a row of cells."""
    left, top, w, h = box
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
    series = sorted(series, key=lambda s: _natural(s.name))
    cols = min(len(series), max(1, int(w // 120)))
    rows = math.ceil(len(series) / cols)
    cell_w, cell_h = w / cols, (h - 8) / rows
    size = max(10, min(40, cell_h * 0.45, cell_w * 0.25))
    for i, s in enumerate(series):
        finite = [v for v in s.values if not math.isnan(v)]
        value = finite[-1] if finite else math.nan
        cx, cy = left + (i % cols + 0.5) * cell_w, top + 4 + (i // cols + 0.5) * cell_h
        canvas.fig.text(*canvas.point(cx, cy - size * 0.25), format_value(value, unit), ha="center", va="center",
                        fontsize=size, fontweight="bold", color=threshold_color(value, panel))
        canvas.fig.text(*canvas.point(cx, cy + size * 0.75 + 4), s.name, ha="center", va="center", fontsize=8,
                        color=MUTED)


def _panel(canvas: _Canvas, panel: dict, data: DashboardData, layout: Layout, grid_top: float) -> None:
    pos = panel["gridPos"]
    column = (layout.width_px - layout.gap_px) / GRID_COLUMNS
    left = layout.gap_px + pos["x"] * column
    top = grid_top + pos["y"] * layout.row_px
    w, h = pos["w"] * column - layout.gap_px, pos["h"] * layout.row_px - layout.gap_px
    canvas.fig.patches.append(Rectangle(canvas.rect(left, top, w, h)[:2], w / canvas.width, h / canvas.height,
                                        transform=canvas.fig.transFigure, facecolor=PANEL, edgecolor=BORDER,
                                        linewidth=0.8, zorder=-1))
    canvas.fig.text(*canvas.point(left + 8, top + 14), panel.get("title", ""), fontsize=10, fontweight="bold",
                    color=TEXT, va="center")
    series = [s for s in data.panels.get(panel["id"], []) if s.values]
    body = (left, top + 24, w, h - 24)
    if not series:
        canvas.fig.text(*canvas.point(left + w / 2, top + h / 2 + 8), "No data", ha="center", va="center",
                        fontsize=14, color=MUTED)
    elif panel.get("type") == "heatmap":
        _heatmap(canvas, panel, series, data, body)
    elif panel.get("type") == "stat":
        _stat(canvas, panel, series, body)
    else:
        _timeseries(canvas, panel, series, data, body)


def _utc(t: float, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime(fmt)


def _header(canvas: _Canvas, board: dict, data: DashboardData, layout: Layout) -> None:
    shown = {k: v for k, v in data.variables.items() if k != "datasource"}
    line = (f"{_utc(data.start)} to {_utc(data.end, '%H:%M:%S')} UTC"
            + "".join(f"   ${k} = {v}" for k, v in shown.items()))
    canvas.fig.text(*canvas.point(layout.gap_px + 4, 18), board.get("title", ""), fontsize=15, fontweight="bold",
                    color=TEXT, va="center")
    text = canvas.fig.text(*canvas.point(layout.gap_px + 4, 42), line, fontsize=9, color=MUTED, va="center")
    x = layout.gap_px + 4 + canvas.width_of(text) + 30
    for i, a in enumerate(data.annotations):
        label = f"{a.title} {_utc(a.time, '%H:%M:%S')}"
        if x + 20 + 9 * 0.6 * len(label) > canvas.width - layout.gap_px:
            canvas.fig.text(*canvas.point(x, 42), f"+{len(data.annotations) - i} more", fontsize=9, color=MUTED,
                            va="center")
            break
        canvas.fig.lines.append(Line2D([x / canvas.width, (x + 16) / canvas.width], [canvas.point(0, 42)[1]] * 2,
                                       transform=canvas.fig.transFigure, color=a.color, linestyle=(0, (4, 2))))
        x += 20 + canvas.width_of(canvas.fig.text(*canvas.point(x + 20, 42), label, fontsize=9, color=TEXT,
                                                  va="center")) + 18


def draw(board: dict, data: DashboardData, layout: Layout = Layout()) -> Figure:
    """The picture of ``board`` showing ``data``: a Figure of ``layout.width_px`` by (header + grid) pixels."""
    panels = board.get("panels", [])
    rows = max((p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels), default=1)
    width, height = layout.width_px, layout.header_px + rows * layout.row_px + layout.gap_px
    fig = Figure(figsize=(width / layout.dpi, height / layout.dpi), dpi=layout.dpi, facecolor=BACKGROUND)
    FigureCanvasAgg(fig)
    canvas = _Canvas(fig, width, height)
    with matplotlib.rc_context({"text.parse_math": False}):  # "$job = ..." is text, not TeX
        _header(canvas, board, data, layout)
        for panel in panels:
            _panel(canvas, panel, data, layout, layout.header_px)
    return fig


def save(fig: Figure, path: Path) -> Path:
    """Write ``fig`` as a PNG at its own size and dpi."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=fig.dpi, facecolor=fig.get_facecolor())
    return path


def render(board_path: Path, client, out: Path, *, start: float, end: float, step: float,
           variables: dict[str, str] | None = None, layout: Layout = Layout(), scrape_interval_s: float = 15.0,
           rate_interval: str | None = None) -> Path:
    """Query Prometheus for the dashboard in ``board_path`` and save its picture at ``out``."""
    board = json.loads(Path(board_path).read_text())
    data = collect(board, client, start=start, end=end, step=step, variables=variables,
                   scrape_interval_s=scrape_interval_s, rate_interval=rate_interval)
    return save(draw(board, data, layout), out)


# ---- command line ------------------------------------------------------------------------------------------

_RELATIVE = re.compile(r"^(?:now)?-(\d+(?:\.\d+)?)([smhd])$")


def parse_time(text: str, now: float) -> float:
    """``now``, ``now-15m`` (Grafana's form; also ``s``, ``h``, ``d``), a unix time, or an ISO 8601 time (UTC
    unless it says)."""
    if text == "now":
        return now
    match = _RELATIVE.match(text)
    if match:
        return now - float(match.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a time: {text!r} (now, now-15m, a unix time or ISO 8601)") from None
    return (when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)).timestamp()


def _variable(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name.lstrip("$"), value


def output_name(board_path: Path) -> str:
    """``dashboards/grafana/job.json`` -> ``dashboard-job.png``."""
    return f"dashboard-{Path(board_path).stem}.png"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Variables not given take the dashboard's 'All' value, else the first value "
                                       "Prometheus has for them (as Grafana does on opening a dashboard).")
    p.add_argument("dashboards", nargs="+", type=Path, help="dashboard JSON files (dashboards/grafana/*.json)")
    p.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL (default %(default)s)")
    p.add_argument("--start", default="now-15m",
                   help="start: now-15m, now-2h, a unix time or ISO 8601, UTC unless it says (default %(default)s)")
    p.add_argument("--end", default="now", help="end, same forms (default %(default)s)")
    p.add_argument("--step", type=float, default=None,
                   help="seconds between points (default: the range / 400, at least 1)")
    p.add_argument("--var", dest="variables", action="append", type=_variable, default=[], metavar="NAME=VALUE",
                   help="a dashboard variable's value, e.g. job=gpt-small or node='gpu-a1|gpu-a2' (repeatable)")
    p.add_argument("--scrape-interval", type=float, default=15.0,
                   help="Prometheus's scrape interval in seconds, for $__rate_interval (default %(default)s)")
    p.add_argument("--rate-interval", default=None, help="$__rate_interval itself, e.g. 1m (overrides the above)")
    p.add_argument("--out", type=Path, default=Path("."),
                   help="directory for dashboard-<name>.png (default: the current one)")
    p.add_argument("--width", type=int, default=1600, help="picture width in pixels (default %(default)s)")
    p.add_argument("--dpi", type=int, default=100, help="dots per inch (default %(default)s)")
    args = p.parse_args(argv)
    now = time.time()
    try:
        start, end = parse_time(args.start, now), parse_time(args.end, now)
    except argparse.ArgumentTypeError as err:
        p.error(str(err))
    if end <= start:
        p.error(f"--end ({args.end}) must be after --start ({args.start})")
    step = args.step or max(1.0, round((end - start) / 400))
    try:
        boards = {path: json.loads(path.read_text()) for path in args.dashboards}
    except (OSError, ValueError) as err:
        p.error(f"cannot read a dashboard: {err}")
    declared = {path: {v["name"] for v in board.get("templating", {}).get("list", [])} for path, board in boards.items()}
    given = dict(args.variables)
    unknown = sorted(set(given) - set().union(*declared.values()))
    if unknown:  # a variable one of the dashboards lacks is for the others; one that none has is a mistake
        p.error(f"no dashboard given has the variable {', '.join(unknown)}")
    client = PrometheusClient(args.prometheus)
    layout = Layout(width_px=args.width, dpi=args.dpi)
    for path, board in boards.items():
        out = args.out / output_name(path)
        try:
            data = collect(board, client, start=start, end=end, step=step,
                           variables={k: v for k, v in given.items() if k in declared[path]},
                           scrape_interval_s=args.scrape_interval, rate_interval=args.rate_interval)
            save(draw(board, data, layout), out)
        except (OSError, ValueError, KeyError, QueryError) as err:
            print(f"render: {path}: {err}", file=sys.stderr)
            return 1
        print(f"wrote {out} ({out.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The Grafana dashboards' queries, run against Prometheus the way Grafana runs them, without Grafana.

A dashboard (``dashboards/grafana/*.json``) holds PromQL with Grafana's variables in it: its own (``$job``,
``$node``) and the built-in ones (``$__rate_interval``, ``$__interval``, ``$__range``). ``fill`` substitutes
them; it is the one implementation that both the dashboard pictures (``dashboards/render.py``) and the test
that runs every dashboard query against a real Prometheus (tests/integration/test_prometheus.py) use.

``resolve_variables`` gives each dashboard variable a value as Grafana would on opening the dashboard: the
value asked for, else the "All" value of a variable that has one, else the first of its ``label_values(...)``.
``collect`` runs every panel's targets and every annotation with ``/api/v1/query_range`` through a
``client`` (``PrometheusClient``, or a fake in tests) and returns plain data (``Series``, ``Annotation``)
for the renderer. Nothing here draws.
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Mapping, Protocol

__all__ = ["Annotation", "DashboardData", "PrometheusClient", "QueryError", "Series", "builtin_values", "collect",
           "fill", "legend", "resolve_variables"]

_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|([A-Za-z_]\w*))|\[\[(\w+)\]\]")
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.+?)\s*,\s*)?(\w+)\s*\)\s*$")


class QueryError(Exception):
    """Prometheus refused or failed a query; the query is named. Retrying the same query will not help unless
    Prometheus was still starting."""


def fill(expr: str, values: Mapping[str, str]) -> str:
    """``expr`` with each ``$name``, ``${name}`` and ``[[name]]`` replaced by ``values[name]``. A name that
    ``values`` lacks is an error (``KeyError`` naming it), never a query sent with a ``$`` left in it.
    ``$1`` (a ``label_replace`` group) is not a variable and stays."""

    def one(match: re.Match) -> str:
        name = next(g for g in match.groups() if g)
        if name not in values:
            raise KeyError(f"no value for the dashboard variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(one, expr)


def _duration(seconds: float) -> str:
    return f"{max(1, round(seconds))}s"


def builtin_values(*, step_s: float, range_s: float, scrape_interval_s: float = 15.0,
                   rate_interval: str | None = None) -> dict[str, str]:
    """Grafana's built-in variables for a query of ``range_s`` seconds at ``step_s``: ``$__interval`` is the
    step, ``$__rate_interval`` max(step + scrape interval, 4 x scrape interval) unless given."""
    rate = rate_interval or _duration(max(step_s + scrape_interval_s, 4 * scrape_interval_s))
    return {"__interval": _duration(step_s), "__rate_interval": rate, "__range": _duration(range_s)}


def legend(fmt: str | None, labels: Mapping[str, str]) -> str:
    """A series' name from a target's ``legendFormat``: ``{{label}}`` replaced by the label's value (empty if
    absent). With no format, Grafana's default: the metric name and its labels."""
    if fmt and fmt != "__auto":
        return _LEGEND.sub(lambda m: labels.get(m.group(1), ""), fmt)
    name = labels.get("__name__", "")
    rest = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
    return f"{name}{{{rest}}}" if rest or not name else name


@dataclass(frozen=True)
class Series:
    """One line of a panel: its legend name, its labels and its samples (unix seconds, values)."""

    name: str
    labels: Mapping[str, str]
    times: tuple[float, ...]
    values: tuple[float, ...]


@dataclass(frozen=True)
class Annotation:
    """A vertical mark on every time series panel: where a run of an annotation query's samples begins."""

    time: float
    title: str
    text: str
    color: str


@dataclass
class DashboardData:
    """What ``collect`` found: series per panel id, annotations, and the variables' values used."""

    start: float
    end: float
    variables: dict[str, str]
    panels: dict[int, list[Series]] = field(default_factory=dict)
    annotations: list[Annotation] = field(default_factory=list)


class Client(Protocol):
    """What ``collect`` needs of Prometheus."""

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """The ``result`` of ``/api/v1/query_range``: ``[{"metric": {...}, "values": [[t, "v"], ...]}]``."""

    def label_values(self, label: str, match: str | None, start: float, end: float) -> list[str]:
        """The values of ``label`` on series matching ``match`` (any series if None) within [start, end]."""


class PrometheusClient:
    """Prometheus's HTTP API at ``url`` (e.g. ``http://127.0.0.1:9090``)."""

    def __init__(self, url: str, *, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _get(self, path: str, params: list[tuple[str, str]], what: str):
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                body = json.load(response)
        except urllib.error.HTTPError as err:  # 400 for a bad query: the body says why
            body = json.loads(err.read() or b"{}")
        except (OSError, ValueError) as err:
            raise QueryError(f"{what}: {self.url} did not answer: {err}") from err
        if body.get("status") != "success":
            raise QueryError(f"{what}: {body.get('errorType', 'error')}: {body.get('error', body)}")
        return body["data"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        params = [("query", expr), ("start", f"{start:.3f}"), ("end", f"{end:.3f}"), ("step", f"{step:g}")]
        return self._get("/api/v1/query_range", params, f"query {expr!r}")["result"]

    def label_values(self, label: str, match: str | None, start: float, end: float) -> list[str]:
        params = [("start", f"{start:.3f}"), ("end", f"{end:.3f}")] + ([("match[]", match)] if match else [])
        return self._get(f"/api/v1/label/{label}/values", params, f"label_values({match or ''}, {label})")


def resolve_variables(board: dict, given: Mapping[str, str], client: Client, start: float,
                      end: float) -> dict[str, str]:
    """A value for each of ``board``'s template variables, in their order (a later one's query may use an
    earlier one): ``given[name]``, else the variable's "All" value, else the first of its label values."""
    values: dict[str, str] = {}
    for var in board.get("templating", {}).get("list", []):
        name = var["name"]
        if name in given:
            values[name] = given[name]
        elif var["type"] == "datasource":
            values[name] = "prometheus"
        elif var.get("includeAll") and var.get("allValue"):
            values[name] = var["allValue"]
        else:
            query = var.get("query")
            query = query.get("query", "") if isinstance(query, dict) else query or ""
            match = _LABEL_VALUES.match(query)
            if not match:
                raise ValueError(f"variable ${name}: cannot resolve {query!r}; give it a value")
            selector = fill(match.group(1), values) if match.group(1) else None
            found = sorted(client.label_values(match.group(2), selector, start, end))
            if not found:
                raise ValueError(f"variable ${name}: {query!r} found no value in Prometheus between the start and "
                                 "end; give it a value")
            values[name] = found[0]
    unknown = sorted(set(given) - set(values))
    if unknown:
        raise ValueError(f"the dashboard {board.get('title')!r} has no variable {', '.join(unknown)}")
    return values


def _series(result: list[dict], fmt: str | None) -> list[Series]:
    out = []
    for item in result:
        labels = item.get("metric", {})
        samples = item.get("values", [])
        out.append(Series(name=legend(fmt, labels), labels=labels, times=tuple(float(t) for t, _ in samples),
                          values=tuple(float(v) for _, v in samples)))
    return out


def _annotations(result: list[dict], spec: dict, step: float) -> list[Annotation]:
    """An annotation where each run of samples begins (no sample in the 1.5 steps before) and where a run's
    value rises: a ``changes(...[1m]) > 0`` query is true for a minute after an event, and counts one more for
    each further event in that minute (Grafana draws the run as one region; the picture marks each event)."""
    out = []
    for series in _series(result, spec.get("titleFormat")):
        text = legend(spec.get("textFormat") or spec.get("titleFormat"), series.labels)
        last_t, last_v = -math.inf, math.nan
        for t, v in zip(series.times, series.values):
            if math.isnan(v):
                continue
            if t - last_t > 1.5 * step or v > last_v:
                out.append(Annotation(time=t, title=series.name, text=text, color=spec.get("iconColor", "red")))
            last_t, last_v = t, v
    return sorted(out, key=lambda a: a.time)


def collect(board: dict, client: Client, *, start: float, end: float, step: float,
            variables: Mapping[str, str] | None = None, scrape_interval_s: float = 15.0,
            rate_interval: str | None = None) -> DashboardData:
    """Run every panel target and enabled annotation of ``board`` over [start, end] at ``step`` seconds."""
    values = resolve_variables(board, variables or {}, client, start, end)
    builtins = builtin_values(step_s=step, range_s=end - start, scrape_interval_s=scrape_interval_s,
                              rate_interval=rate_interval)
    everything = {**values, **builtins}
    data = DashboardData(start=start, end=end, variables=values)
    for panel in board.get("panels", []):
        found: list[Series] = []
        for target in panel.get("targets", []):
            if target.get("hide") or not target.get("expr"):
                continue
            result = client.query_range(fill(target["expr"], everything), start, end, step)
            found += _series(result, target.get("legendFormat"))
        data.panels[panel["id"]] = found
    for spec in board.get("annotations", {}).get("list", []):
        if spec.get("enable", True) and spec.get("expr"):
            result = client.query_range(fill(spec["expr"], everything), start, end, step)
            data.annotations += _annotations(result, spec, step)
    data.annotations.sort(key=lambda a: a.time)
    return data

"""How a panel shows a value: in its unit (``fieldConfig.defaults.unit``, as Grafana formats the units the
dashboards use), with axis ticks that are round in that unit, and coloured by the panel's thresholds."""

from __future__ import annotations

import math

from matplotlib.ticker import MaxNLocator

__all__ = ["THRESHOLD_COLORS", "format_value", "locator", "threshold_color"]

THRESHOLD_COLORS = {"green": "#73BF69", "red": "#F2495C", "orange": "#FF9830", "yellow": "#FADE2A",
                    "blue": "#5794F2"}
"""Grafana's named colours as its dark theme draws them."""


def _scaled(value: float, base: float, prefixes: list[str], suffix: str, sep: str = " ") -> str:
    magnitude, i = abs(value), 0
    while magnitude >= base and i < len(prefixes) - 1:
        magnitude /= base
        i += 1
    return f"{value / base**i:.3g}{sep}{prefixes[i]}{suffix}".rstrip()


def format_value(value: float, unit: str) -> str:
    """``value`` as Grafana shows it in ``unit`` (the units the dashboards use; anything else: a plain number)."""
    if value is None or math.isnan(value):
        return "–"
    if unit == "percentunit":
        return f"{value * 100:.3g}%"
    if unit == "s":
        if value == 0 or abs(value) >= 1:
            return _scaled(value, 60, ["s", "min"], "") if abs(value) >= 600 else f"{value:.3g} s"
        return f"{value * 1000:.3g} ms"
    if unit in ("bytes", "Bps"):
        return _scaled(value, 1024, ["B", "KiB", "MiB", "GiB", "TiB", "PiB"], "/s" if unit == "Bps" else "")
    if unit == "celsius":
        return f"{value:.0f} °C"
    if unit == "watt":
        return _scaled(value, 1000, ["", "k", "M"], "W")
    return _scaled(value, 1000, ["", "k", "M", "G", "T"], "", sep="")


class _ScaledLocator(MaxNLocator):
    """Round ticks in the unit a value is shown in (0, 5, 10 GiB rather than 0, 5.37e9, ...)."""

    def __init__(self, base: float) -> None:
        super().__init__(nbins=5, steps=[1, 2, 2.5, 5, 10])
        self.base = base

    def tick_values(self, vmin, vmax):
        top = max(abs(vmin), abs(vmax))
        scale = self.base ** max(0, math.floor(math.log(top, self.base))) if top > 0 else 1
        return super().tick_values(vmin / scale, vmax / scale) * scale


def locator(unit: str) -> MaxNLocator:
    """Ticks for an axis in ``unit``: round numbers in the unit a value is shown in."""
    if unit in ("bytes", "Bps"):
        return _ScaledLocator(1024)
    return MaxNLocator(nbins=5, steps=[1, 2, 2.5, 5, 10])


def threshold_color(value: float, panel: dict) -> str:
    """The colour of ``value`` by the panel's thresholds (``fieldConfig.defaults.thresholds``; Grafana's default:
    green)."""
    steps = panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps") or [
        {"color": "green", "value": None}]
    color = steps[0]["color"]
    for step in steps[1:]:
        if not math.isnan(value) and value >= step["value"]:
            color = step["color"]
    return THRESHOLD_COLORS.get(color, color)

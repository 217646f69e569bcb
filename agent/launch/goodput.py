"""Where a job's wall time went, as the launcher of `trainwarden run` sees it (issue 27, first slice): the share that
trained the model (goodput) and the rest by cause (badput).

Fed by the supervisor (agent/launch/run.py): each worker round's start, each failed round, and every step a rank
reports (telemetry: the step's index, end time and duration). The first report of a step index counts; the others
(the same step on the other ranks) do not. Time is the workers' wall clock, from the launch to the latest step or
failure (``as_of``), cut into:

- ``productive``: the steps the job kept. A step recomputed after a restart counts once, the recomputation;
- ``startup``: the launch to the start of the first step (interpreters, imports, rendezvous, restore);
- ``detection``: the end of the last step before a failure to the launcher's report of it (a hang's wait, the step
  that was in flight);
- ``restart``: the failure's report to the start of the next round's first step (stop, rendezvous, spawn, restore);
- ``lost_progress``: the steps completed after the checkpoint the job resumed from, and so computed twice;
- ``rendezvous``: a new round that no failure caused (a node left or joined) to its first step;
- ``between_steps``: the gaps between one step's end and the next one's start within a round (data loading or a
  checkpoint save outside ``rt.step``, logging).

Their sum is the wall time up to rounding and the ranks' small skew. Not yet: persisting the ledger in etcd across
launchers and daemon generations, hang/straggler/communication-regression causes, MFU (issue 27's later items).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["CAUSES", "Goodput", "GoodputLedger"]

CAUSES = ("startup", "detection", "restart", "lost_progress", "rendezvous", "between_steps")

_RECENT = 100_000
"""Steps kept (index and duration) to move to ``lost_progress`` when a restart recomputes them."""


@dataclass(frozen=True)
class Goodput:
    wall_s: float
    productive_s: float
    badput_s: dict[str, float]

    @property
    def ratio(self) -> float | None:
        return self.productive_s / self.wall_s if self.wall_s > 0 else None

    def describe(self) -> str:
        """``91.2% of 65.3s (startup 5.1s, restart 3.2s, ...)``: the causes with any time, largest first."""
        if self.ratio is None:
            return "no step yet"
        words = {"lost_progress": "steps redone", "between_steps": "between steps"}
        parts = [f"{words.get(cause, cause)} {seconds:.1f}s" for cause, seconds in
                 sorted(self.badput_s.items(), key=lambda kv: -kv[1]) if seconds >= 0.05]
        return f"{100 * self.ratio:.1f}% of {self.wall_s:.1f}s" + (f" ({', '.join(parts)})" if parts else "")


class GoodputLedger:
    """The accounting (module docstring); thread-safe, O(1) per report but for a restart's look-back."""

    def __init__(self, job: str, *, launched_at: float, node: str = "") -> None:
        self.job, self.node, self._launched = job, node, launched_at
        self._lock = threading.Lock()
        self._productive = 0.0
        self._causes = dict.fromkeys(CAUSES, 0.0)
        self._frontier: int | None = None  # highest step index counted
        self._recent: deque[tuple[int, float]] = deque(maxlen=_RECENT)
        self._last_end: float | None = None
        self._new_round = True
        self._round_at: float | None = None
        self._failed_at: float | None = None
        self._as_of = launched_at

    def round_started(self, at: float | None = None) -> None:
        """A worker round started (at wall time ``at``: a step that started before it is a late report of an
        earlier round's)."""
        with self._lock:
            self._new_round = True
            self._round_at = at

    def failed(self, at: float) -> None:
        """The launcher reported the round failed at wall time ``at``."""
        with self._lock:
            if self._failed_at is not None:
                return  # a second failure before any step: one outage, measured from the first
            self._failed_at = at
            if self._last_end is not None and at > self._last_end:
                self._causes["detection"] += at - self._last_end
            self._as_of = max(self._as_of, at)

    def step(self, index: int, end: float, duration: float) -> None:
        """A rank completed step ``index`` at wall time ``end`` after ``duration`` seconds."""
        start = end - max(0.0, duration)
        with self._lock:
            first = self._new_round and (self._round_at is None or start >= self._round_at)
            if first:
                self._new_round = False
                if self._last_end is None:
                    self._causes["startup"] += max(0.0, start - self._launched)
                elif self._failed_at is not None:
                    self._causes["restart"] += max(0.0, start - self._failed_at)
                else:
                    self._causes["rendezvous"] += max(0.0, start - self._last_end)
                self._failed_at = None
                if self._frontier is not None and index <= self._frontier:  # resumed from an older checkpoint
                    self._redo_from(index)
            if self._frontier is not None and index <= self._frontier:
                return  # another rank's report of a step counted already
            if not first and self._last_end is not None and start > self._last_end:
                self._causes["between_steps"] += start - self._last_end
            self._productive += max(0.0, duration)
            self._recent.append((index, max(0.0, duration)))
            self._frontier = index
            self._last_end = end if self._last_end is None else max(self._last_end, end)
            self._as_of = max(self._as_of, end)

    def _redo_from(self, index: int) -> None:
        lost = 0.0
        while self._recent and self._recent[-1][0] >= index:
            lost += self._recent.pop()[1]
        self._productive -= lost
        self._causes["lost_progress"] += lost
        self._frontier = index - 1

    def snapshot(self) -> Goodput:
        with self._lock:
            return Goodput(wall_s=max(0.0, self._as_of - self._launched), productive_s=self._productive,
                           badput_s=dict(self._causes))

    def collect(self) -> Iterator[Metric]:
        """``trainwarden_goodput_ratio{job,node}``, ``trainwarden_productive_seconds{job,node}`` and
        ``trainwarden_badput_seconds_total{job,node,cause}``; a prometheus_client collector."""
        g = self.snapshot()
        labels = [self.job, self.node]
        ratio = GaugeMetricFamily("trainwarden_goodput_ratio", "Share of the job's wall time (launch to its latest "
                                  "step) spent in the steps it kept, as this node's launcher counts it",
                                  labels=["job", "node"])
        if g.ratio is not None:
            ratio.add_metric(labels, g.ratio)
        yield ratio
        productive = GaugeMetricFamily("trainwarden_productive_seconds", "Wall time of the steps the job kept (a "
                                       "gauge: a restart that recomputes steps moves their first run to badput)",
                                       labels=["job", "node"])
        productive.add_metric(labels, g.productive_s)
        yield productive
        badput = CounterMetricFamily("trainwarden_badput_seconds", "Wall time that trained nothing the job kept, by "
                                     "cause (agent/launch/goodput.py)", labels=["job", "node", "cause"])
        for cause in CAUSES:
            badput.add_metric([*labels, cause], g.badput_s[cause])
        yield badput

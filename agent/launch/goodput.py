"""Where a job's wall time went (issue 27): the share that trained the model (goodput) and the rest by cause
(badput), across the launcher's restarts and, persisted, across launchers, nodes and daemon generations.

Fed by the supervisor (agent/launch/run.py): each worker round's start, each failed round, every step a rank
reports (telemetry: the step's index, end time and duration), checkpoint stalls and restores, and the watchdog's
incidents (a hang; a straggler or a communication regression while it lasts). The first report of a step index
counts; the others (the same step on the other ranks) do not. Time is the workers' wall clock, from the job's
first launch to its latest step or failure (``as_of``), cut into:

- ``productive``: the steps the job kept, at the job's own pace. A step recomputed after a restart counts once, the
  recomputation; the part of a step above the job's median while a straggler or a communication regression is
  open is charged to that cause instead. Steps this ledger never heard of, which a round starts past (trained while
  this node was away, or after the last state a killed launcher published), count at the job's recent pace, out of
  the wait they fell in;
- ``startup``: the launch to the start of the first step (interpreters, imports, rendezvous), less ``restore``;
- ``restore``: reading the checkpoint back before a round's first step (the slowest rank's report);
- ``detection``: the end of the last step before a failure to the launcher's report of it (the step in flight);
- ``hang``: the same for a failure the watchdog's hang detection caused (the hang's wait and the abort);
- ``restart``: the failure's report to the start of the next round's first step (stop, rendezvous, spawn), less
  ``restore``;
- ``lost_progress``: the steps completed after the checkpoint the job resumed from, and so computed twice;
- ``rendezvous``: a new round that no failure caused (a node left or joined; waiting for nodes) to its first step;
- ``spare_swap``: what ``restart`` or ``rendezvous`` would be for a round in which a hot spare took a lost node's
  place (its close record names the swap: agent/rendezvous/native.py), so a swap's recovery reads apart from a
  shrink's or a crash's;
- ``checkpoint_stall``: the part of the gap after a step that the checkpoint's save held the training loop;
- ``between_steps``: the rest of the gaps between one step's end and the next one's start within a round (data
  loading outside ``rt.step``, logging);
- ``straggler`` and ``comm_regression``: a step's excess over the job's median step while that incident is open;
- ``stopped``: no launcher ran the job (stopped by its owner, the node away) between a persisted ledger's last
  word and the next launch.

Their sum is the wall time up to rounding and the ranks' small skew. ``state()`` and ``GoodputLedger.resume``
carry the ledger from one launcher to the next (agent/launch/goodput_store.py keeps it in etcd and the state
directory).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["CAUSES", "CAUSE_LABELS", "SLOW_CAUSES", "Goodput", "GoodputLedger"]

CAUSES = ("startup", "restore", "detection", "hang", "restart", "lost_progress", "rendezvous", "checkpoint_stall",
          "between_steps", "straggler", "comm_regression", "stopped", "spare_swap")
SLOW_CAUSES = ("straggler", "comm_regression")
CAUSE_LABELS = {"lost_progress": "steps redone", "between_steps": "between steps", "checkpoint_stall":
                "checkpoint stall", "comm_regression": "communication regression", "spare_swap": "spare swap"}
"""How a cause reads to people, where its name is not already the word (the summary, status, the report)."""

_RECENT = 8_192
"""Steps kept (index and duration) to move to ``lost_progress`` when a restart recomputes them; a restart further
back than that estimates the older ones with their mean (as a resume past the persisted ones does). About 66 bytes a
step (tracemalloc): 100,000 of them were 6.6 MB that every week-long job's launcher would have grown by."""
_PERSISTED_RECENT = 512
"""Of those, the ones a persisted ledger carries (a resume further back than that estimates with their mean)."""
_BASELINE = 64
"""Steps of the job's own pace (no slow cause open) whose median is the baseline for a slow step's excess."""


@dataclass(frozen=True)
class Goodput:
    wall_s: float
    productive_s: float
    badput_s: dict[str, float]

    @property
    def ratio(self) -> float | None:
        return self.productive_s / self.wall_s if self.wall_s > 0 else None

    @classmethod
    def from_json(cls, data: dict) -> "Goodput":
        """A ``to_json()`` (or a ledger's ``state()``); ValueError/KeyError/TypeError when it is not one."""
        return cls(wall_s=float(data["wall_s"]), productive_s=float(data["productive_s"]),
                   badput_s={str(k): float(v) for k, v in dict(data["badput_s"]).items()})

    def to_json(self) -> dict:
        return {"wall_s": round(self.wall_s, 3), "productive_s": round(self.productive_s, 3),
                "badput_s": {cause: round(seconds, 3) for cause, seconds in self.badput_s.items()},
                "ratio": None if self.ratio is None else round(self.ratio, 5)}

    def describe(self) -> str:
        """``91.2% of 65.3s (startup 5.1s, restart 3.2s, ...)``: the causes with any time, largest first."""
        if self.ratio is None:
            return "no step yet"
        parts = [f"{CAUSE_LABELS.get(cause, cause)} {seconds:.1f}s" for cause, seconds in
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
        self._new_round, self._swap = True, False
        self._round_at: float | None = None
        self._failed_at: float | None = None
        self._hung = False  # the watchdog found the current round hung: its failure's wait is ``hang``
        self._restore = 0.0  # the current round's restore, before its first step
        self._stall = 0.0  # a checkpoint save's stall, not yet set against a gap
        self._stall_step: int | None = None
        self._slow: set[str] = set()  # open slow causes (SLOW_CAUSES)
        self._open_slow: dict[str, set[str]] = {}  # cause -> ids of its open incidents
        self._baseline: deque[float] = deque(maxlen=_BASELINE)
        self._as_of = launched_at
        self._resumed_at: float | None = None
        self._stopped_at_resume = 0.0  # the ``stopped`` a resume added, which may hold steps it never heard of

    # ---- carried from one launcher to the next ---------------------------------------------------------

    def state(self) -> dict:
        """What ``resume`` needs, JSON-ready (the snapshot's numbers too, for readers that only display)."""
        with self._lock:
            g = self._snapshot()
            return {**g.to_json(), "launched": round(self._launched, 3), "as_of": round(self._as_of, 3),
                    "frontier": self._frontier, "node": self.node,
                    "recent": [[i, round(d, 4)] for i, d in list(self._recent)[-_PERSISTED_RECENT:]]}

    def resume(self, state: dict, *, now: float) -> None:
        """Continue a persisted ledger (``state()`` of an earlier launcher of the job): its time counts, and the
        gap from its last word to ``now`` (this launch) is ``stopped``. Before any report; a malformed state
        raises ValueError and changes nothing."""
        launched, as_of = float(state["launched"]), float(state["as_of"])
        causes = {cause: float(state["badput_s"].get(cause, 0.0)) for cause in CAUSES}
        productive = float(state["productive_s"])
        frontier = None if state.get("frontier") is None else int(state["frontier"])
        recent = [(int(i), float(d)) for i, d in state.get("recent") or []]
        if not launched <= as_of or productive < 0 or min(causes.values()) < 0:
            raise ValueError(f"inconsistent goodput state (launched {launched}, as of {as_of})")
        with self._lock:
            self._launched, self._productive, self._frontier = launched, productive, frontier
            self._causes = causes
            self._stopped_at_resume = max(0.0, now - as_of)
            self._causes["stopped"] += self._stopped_at_resume
            self._as_of = max(as_of, now)
            self._recent.extend(recent)
            self._resumed_at = now

    # ---- what the launcher reports ---------------------------------------------------------------------

    def round_started(self, at: float | None = None, *, spare_swap: bool = False) -> None:
        """A worker round started (at wall time ``at``: a step that started before it is a late report of an
        earlier round's); ``spare_swap``: in it a hot spare took a lost node's place (the wait for its first step
        is ``spare_swap``)."""
        with self._lock:
            self._new_round, self._swap = True, spare_swap
            self._round_at = at
            self._restore = 0.0

    def failed(self, at: float) -> None:
        """The launcher reported the round failed at wall time ``at``."""
        with self._lock:
            if self._failed_at is not None:
                return  # a second failure before any step: one outage, measured from the first
            self._failed_at = at
            if self._last_end is not None and at > self._last_end:
                self._causes["hang" if self._hung else "detection"] += at - self._last_end
            self._hung = False
            self._as_of = max(self._as_of, at)

    def hang_detected(self) -> None:
        """The watchdog found the job hung: the wait up to the round's failure is ``hang``, not ``detection``."""
        with self._lock:
            self._hung = True

    def slow(self, cause: str, open_: bool) -> None:
        """A straggler or a communication regression opened (``open_``) or ended."""
        if cause not in SLOW_CAUSES:
            raise ValueError(f"not a slow cause: {cause!r}")
        with self._lock:
            (self._slow.add if open_ else self._slow.discard)(cause)

    def incident(self, kind: str, state: str, incident_id: str) -> None:
        """A version of one of the job's incidents (agent/incidents/record.py's kinds and states): a hang marks the
        round hung; a straggler or a communication regression is a slow cause while it is open."""
        if kind == "hang":
            self.hang_detected()
            return
        cause = {"straggler_start": "straggler", "comm_regression": "comm_regression"}.get(kind)
        if cause is None:
            return
        with self._lock:
            ids = self._open_slow.setdefault(cause, set())
            (ids.discard if state in ("resolved", "failed") else ids.add)(incident_id)
            (self._slow.add if ids else self._slow.discard)(cause)

    def checkpoint_stall(self, step: int, seconds: float) -> None:
        """A rank's save of ``step`` held its training loop ``seconds`` (the slowest rank's counts)."""
        with self._lock:
            if step != self._stall_step:
                self._stall_step, self._stall = step, 0.0
            self._stall = max(self._stall, seconds)

    def restored(self, seconds: float) -> None:
        """A rank read its checkpoint back in ``seconds`` before this round's first step (the slowest counts)."""
        with self._lock:
            if self._new_round:
                self._restore = max(self._restore, max(0.0, seconds))

    def step(self, index: int, end: float, duration: float) -> None:
        """A rank completed step ``index`` at wall time ``end`` after ``duration`` seconds."""
        duration = max(0.0, duration)
        start = end - duration
        with self._lock:
            first = self._new_round and (self._round_at is None or start >= self._round_at)
            if first:
                self._first_of_round(index, start)
            if self._frontier is not None and index <= self._frontier:
                return  # another rank's report of a step counted already
            if not first and self._last_end is not None and start > self._last_end:
                gap = start - self._last_end
                stall = min(self._stall, gap)
                self._causes["checkpoint_stall"] += stall
                self._causes["between_steps"] += gap - stall
            self._stall = 0.0
            kept = duration
            if self._slow and len(self._baseline) >= 8:
                excess = max(0.0, duration - _median(self._baseline))
                self._causes[sorted(self._slow)[0]] += excess
                kept -= excess
            elif not self._slow:
                self._baseline.append(duration)
            self._productive += kept
            self._recent.append((index, kept))
            self._frontier = index
            self._last_end = end if self._last_end is None else max(self._last_end, end)
            self._as_of = max(self._as_of, end)

    def _first_of_round(self, index: int, start: float) -> None:
        self._new_round = False
        if self._last_end is None:  # this launcher's first step (a resumed ledger's: from this launch)
            cause, since = "startup", self._resumed_at if self._resumed_at is not None else self._launched
        elif self._failed_at is not None:
            cause, since = "restart", self._failed_at
        else:
            cause, since = "rendezvous", self._last_end
        if self._swap and cause != "startup":
            cause = "spare_swap"
        gap = max(0.0, start - since)
        restore = min(self._restore, gap)
        self._causes["restore"] += restore
        self._causes[cause] += gap - restore - self._trained_elsewhere(index, cause, gap - restore)
        self._failed_at, self._restore, self._stall, self._hung = None, 0.0, 0.0, False
        if self._frontier is not None and index <= self._frontier:  # resumed from an older checkpoint
            self._redo_from(index)

    def _trained_elsewhere(self, index: int, cause: str, gap: float) -> float:
        """A round that starts past the step after the frontier: the steps between were trained and kept while this
        ledger heard nothing (this node was away, a spare, or fenced, while the others trained; or its launcher was
        killed after its last published state). They are productive, at the job's recent pace: taken from the
        wait before this round (``gap``), or, for a relaunch's first round, from the ``stopped`` that its resume
        counted (the steps were before the launch). Returns what it took from ``gap``."""
        if self._frontier is None or index <= self._frontier + 1 or not self._recent:
            return 0.0
        mean = sum(d for _, d in self._recent) / len(self._recent)
        estimate = (index - self._frontier - 1) * mean
        if cause == "startup":
            taken = min(estimate, self._causes["stopped"], self._stopped_at_resume)
            self._causes["stopped"] -= taken
            self._stopped_at_resume = 0.0
            self._productive += taken
            return 0.0
        taken = min(estimate, max(0.0, gap))
        self._productive += taken
        return taken

    def _redo_from(self, index: int) -> None:
        mean = sum(d for _, d in self._recent) / len(self._recent) if self._recent else 0.0
        lost, steps = 0.0, 0
        while self._recent and self._recent[-1][0] >= index:
            lost += self._recent.pop()[1]
            steps += 1
        missing = (self._frontier - index + 1) - steps  # beyond what a persisted ledger carried
        if missing > 0:
            lost += missing * mean
        lost = min(lost, self._productive)
        self._productive -= lost
        self._causes["lost_progress"] += lost
        self._frontier = index - 1

    def snapshot(self) -> Goodput:
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> Goodput:
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


def _median(values) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2

"""Recording what the straggler detector is fed, and replaying it: detectors are tuned and tested on traces
of real jobs, not only on the reference job (DESIGN.md: "Works on the user's job, not only ours").

With ``TRAINWARDEN_STRAGGLER_TRACE_DIR`` set (or ``WatchdogConfig.straggler_trace_dir``), the watchdog appends
one JSON line per job and check to ``<dir>/<job>.jsonl``: the agent's monotonic time, the step time it
used, the peer groups, whether the worker round was past its warm-up, and the new intervals per rank in
microseconds, each end as the difference from the rank's previous end (``[end_delta_us, total_us,
compute_us]``; the first end of a rank in a file is absolute), which keeps recorded traces small, and each
rank's cumulative counters (``totals``: steps, step seconds, collective wait seconds, collectives, checkpoint
stage, pid). ``replay`` feeds such a file to a ``StragglerDetector`` exactly as the
watchdog would and returns the events, so a threshold change is judged against recorded jobs of other
shapes and step times (tests/fixtures/straggler/).
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from pathlib import Path
from typing import IO, Iterator, Mapping, Sequence

from trainwarden.agent.telemetry.arrivals import Interval
from trainwarden.agent.watchdog.straggler import StragglerConfig, StragglerDetector, StragglerEvent

__all__ = ["TRACE_DIR_ENV", "TraceUpdate", "TraceWriter", "read_trace", "replay"]

log = logging.getLogger(__name__)

TRACE_DIR_ENV = "TRAINWARDEN_STRAGGLER_TRACE_DIR"


class TraceUpdate(dict):
    """One recorded check: keys ``t``, ``step_s``, ``groups``, ``warm``, ``intervals``."""


class TraceWriter:
    """Appends the detector's input per job to ``<directory>/<job>.jsonl``; never raises into the watchdog."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self._dir = Path(directory)
        self._files: dict[str, IO[str]] = {}
        self._last_end: dict[tuple[str, int], int] = {}

    def write(self, job: str, *, t: float, step_s: float, groups: Mapping[int, int], warm: bool,
              intervals: Mapping[int, Sequence[Interval]], totals: Mapping[int, Sequence] | None = None) -> None:
        """``totals``: each rank's cumulative counters at this check, ``[steps, step seconds, collective wait
        seconds, collectives, checkpoint stage, pid]`` (the input of job-wide detectors such as the
        communication-regression one)."""
        if not intervals and not totals:
            return
        try:
            f = self._files.get(job)
            if f is None:
                self._dir.mkdir(parents=True, exist_ok=True)
                f = self._files[job] = open(self._dir / f"{job}.jsonl", "a", buffering=1)
            encoded = {}
            for rank, items in intervals.items():
                last, rows = self._last_end.get((job, rank), 0), []
                for i in items:
                    end = i.end_ns // 1000
                    rows.append([end - last, i.total_ns // 1000, i.compute_ns // 1000])
                    last = end
                self._last_end[(job, rank)] = last
                encoded[str(rank)] = rows
            record = {"t": round(t, 4), "step_s": step_s, "warm": warm,
                      "groups": {str(r): g for r, g in groups.items()}, "intervals": encoded}
            if totals:
                record["totals"] = {str(r): list(v) for r, v in totals.items()}
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
        except OSError as exc:
            log.warning("cannot record the straggler trace of job %s in %s: %s", job, self._dir, exc)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def read_trace(path: str | os.PathLike) -> Iterator[TraceUpdate]:
    """The updates of a trace file (``.jsonl`` or ``.jsonl.gz``), in order."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        for line in f:
            if line.strip():
                yield TraceUpdate(json.loads(line))


def replay(updates: Iterator[Mapping] | str | os.PathLike, config: StragglerConfig | None = None, *,
           job: str = "replay") -> tuple[list[StragglerEvent], StragglerDetector]:
    """Feed recorded updates to a fresh detector the way the watchdog does; its events and the detector."""
    if isinstance(updates, (str, os.PathLike)):
        updates = read_trace(updates)
    detector = StragglerDetector(config, clock=_ReplayClock())
    events: list[StragglerEvent] = []
    last_end: dict[int, int] = {}
    for u in updates:
        detector.clock.now = float(u["t"])  # type: ignore[attr-defined]
        intervals = {}
        for r, rows in u["intervals"].items():
            rank, end, items = int(r), last_end.get(int(r), 0), []
            for delta, total, compute in rows:
                end += delta
                items.append(Interval(end * 1000, total * 1000, compute * 1000))
            last_end[rank], intervals[rank] = end, items
        if not u.get("warm", True):
            intervals = {}
            detector.new_round(job)
        events += detector.update(job, intervals, step_seconds=float(u["step_s"]),
                                  groups={int(r): g for r, g in u["groups"].items()})
    return events, detector


class _ReplayClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

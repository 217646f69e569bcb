"""What `trainwarden report` shows, gathered from a job's state directory, without plotly.

``gather`` reads the job's history (agent/common/job_history.py: step times, the launcher's events, the latest
goodput), its incident records (agent/incidents/store.py) and its checkpoint directory
(agent/shared/checkpoint_layout.py) into one ``ReportData``; page.py draws it. Every problem a person can fix is a
``ReportError`` whose message says what to do.

The step times are thinned for the page (``downsample``): a trace keeps at most ``POINTS_PER_TRACE`` points,
fewer when many ranks would make the page heavy (``TOTAL_POINTS``), by keeping the fastest and the slowest step
of each stretch of steps, so a spike survives the thinning. Past ``MAX_RANK_TRACES`` ranks the chart shows the
minimum, median and maximum across ranks per step instead of one trace per rank.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainwarden.agent.common.job_history import History, read_history
from trainwarden.agent.common.paths import default_state_home, job_checkpoint_dir, job_state_dir
from trainwarden.agent.incidents.record import Incident
from trainwarden.agent.launch.goodput import CAUSE_LABELS
from trainwarden.agent.incidents.store import list_incidents
from trainwarden.agent.shared import checkpoint_aside as asides
from trainwarden.agent.shared import checkpoint_layout as layout

__all__ = ["CheckpointRow", "MAX_RANK_TRACES", "POINTS_PER_TRACE", "ReportData", "ReportError", "StepSeries",
           "TOTAL_POINTS", "cause_label", "checkpoint_rows", "downsample", "gather", "step_series", "timed_events"]

POINTS_PER_TRACE = 5_000
TOTAL_POINTS = 160_000
"""The step chart's budget across its traces: 8 ranks keep 5,000 points each, 64 ranks 2,500."""
MAX_RANK_TRACES = 64


class ReportError(Exception):
    """A report cannot be made; the message says why and what to do. Retrying does not help."""


def cause_label(cause: str) -> str:
    """A goodput cause as people read it: ``lost_progress`` is "steps redone"."""
    return CAUSE_LABELS.get(cause, cause)


@dataclass(frozen=True)
class StepSeries:
    """One trace of the step chart: wall time (unix seconds), step and duration, in time order. A NaN row
    breaks the line between rounds (a restart) and where the steps start over (a resumed run)."""

    name: str
    end: np.ndarray
    step: np.ndarray
    duration: np.ndarray


@dataclass(frozen=True)
class CheckpointRow:
    step: int
    state: str
    """complete (``latest`` when the pointer names it), unfinished, unreadable, corrupt, or ``set aside (...)``."""
    bytes: int | None
    time: float | None
    """The directory's mtime: the last file written into it (for a committed checkpoint, its commit marker)."""
    detail: str = ""


@dataclass
class ReportData:
    job: str
    state_dir: Path
    history: History
    series: list[StepSeries] = field(default_factory=list)
    per_rank: bool = True
    """One trace per rank; False: min/median/max across ranks (more than ``MAX_RANK_TRACES`` ranks)."""
    ranks: int = 0
    rows: int = 0
    """Step rows read from the history."""
    shown: int = 0
    """Of those, the points the chart keeps."""
    incidents: list[Incident] = field(default_factory=list)
    checkpoint_dir: Path | None = None
    checkpoints: list[CheckpointRow] = field(default_factory=list)

    @property
    def downsampled(self) -> bool:
        return self.shown < self.rows

    def events(self, name: str) -> list[dict]:
        return timed_events(self.history, name)

    def span(self) -> tuple[float, float] | None:
        """The first and last time in the history (events and step ends)."""
        times = [float(e["t"]) for e in timed_events(self.history)]
        if self.history.end:
            times += [min(self.history.end), max(self.history.end)]
        return (min(times), max(times)) if times else None


def timed_events(history: History, *names: str) -> list[dict]:
    """The history's events named ``names`` (all without names) whose time ``t`` is a number."""
    return [e for e in history.events if isinstance(e.get("t"), (int, float)) and not isinstance(e["t"], bool)
            and (not names or e.get("event") in names)]


def gather(job: str, state_home: str | os.PathLike | None = None) -> ReportData:
    """Everything the report shows about ``job`` under ``state_home`` (default ``default_state_home()``)."""
    home = Path(state_home) if state_home is not None else default_state_home()
    try:
        state_dir = job_state_dir(job, home)
    except ValueError as exc:
        raise ReportError(str(exc)) from None
    if not state_dir.is_dir():
        raise ReportError(_unknown_job(job, home, state_dir))
    history = read_history(state_dir / "history")
    if history.empty:
        raise ReportError(f"job {job} has no history in {state_dir / 'history'}: it ran before trainwarden recorded "
                          "a job's history, or it never started (no round, no step); run it again with this "
                          "trainwarden to get a report"
                          + (f" ({history.skipped_lines} unreadable line(s) skipped)" if history.skipped_lines else ""))
    data = ReportData(job=job, state_dir=state_dir, history=history, rows=len(history.step),
                      ranks=len(set(history.rank)))
    data.series, data.per_rank = step_series(history)
    data.shown = sum(int(np.count_nonzero(~np.isnan(s.duration))) for s in data.series)
    data.incidents = list_incidents(home, job)
    data.checkpoint_dir = job_checkpoint_dir(job, home)
    data.checkpoints = checkpoint_rows(data.checkpoint_dir)
    return data


def _unknown_job(job: str, home: Path, state_dir: Path) -> str:
    try:
        known = sorted(p.name for p in (home / "jobs").iterdir() if p.is_dir())
    except OSError:
        known = []
    here = f"jobs with state there: {', '.join(known[:20])}" if known else f"no job has state under {home}"
    return (f"no state directory {state_dir} for job {job} ({here}). `trainwarden jobs` lists the fleet's jobs; "
            "give the node's state home with --state-home (default $TRAINWARDEN_STATE_HOME or "
            "~/.local/state/trainwarden) if the job ran with another")


def step_series(history: History) -> tuple[list[StepSeries], bool]:
    """The step chart's traces (module docstring) and whether they are one per rank."""
    if not history.step:
        return [], True
    rank = np.asarray(history.rank)
    step = np.asarray(history.step, dtype=np.int64)
    end = np.asarray(history.end, dtype=np.float64)
    duration = np.asarray(history.duration, dtype=np.float64)
    ranks = np.unique(rank)
    rounds = np.sort(np.asarray([e["t"] for e in timed_events(history, "launched", "round_started")],
                                dtype=np.float64))
    if len(ranks) > MAX_RANK_TRACES:
        return _across_ranks(step, end, duration, rounds), False
    limit = max(500, min(POINTS_PER_TRACE, TOTAL_POINTS // len(ranks)))
    series = []
    for r in ranks:
        mine = np.flatnonzero(rank == r)
        mine = mine[np.argsort(end[mine], kind="stable")]
        series.append(_series(f"rank {r}", end[mine], step[mine], duration[mine], limit, rounds))
    return series, True


def _across_ranks(step: np.ndarray, end: np.ndarray, duration: np.ndarray,
                  rounds: np.ndarray) -> list[StepSeries]:
    """Min, median and max duration across ranks per step of each round (a step redone after a restart is in a
    later round), at the mean end time of the step's rows."""
    round_of = np.searchsorted(rounds, end, side="right")
    order = np.lexsort((duration, step, round_of))
    step, end, duration, round_of = step[order], end[order], duration[order], round_of[order]
    new_group = np.concatenate([[True], (step[1:] != step[:-1]) | (round_of[1:] != round_of[:-1])])
    first = np.flatnonzero(new_group)
    count = np.diff(np.append(first, len(step)))
    last = first + count - 1
    middle = (duration[first + (count - 1) // 2] + duration[first + count // 2]) / 2  # sorted by duration
    when = np.add.reduceat(end, first) / count
    by_time = np.argsort(when, kind="stable")
    stats = {"min": duration[first], "median": middle, "max": duration[last]}
    return [_series(f"{name} across ranks", when[by_time], step[first][by_time], values[by_time], POINTS_PER_TRACE,
                    rounds) for name, values in stats.items()]


def _series(name: str, end: np.ndarray, step: np.ndarray, duration: np.ndarray, limit: int,
            rounds: np.ndarray) -> StepSeries:
    keep = downsample(duration, limit)
    end, step, duration = end[keep], step[keep], duration[keep]
    round_of = np.searchsorted(rounds, end, side="right")
    # a new round, or the steps start over (a resumed run): the line does not join the two
    breaks = np.flatnonzero((step[1:] <= step[:-1]) | (round_of[1:] != round_of[:-1])) + 1
    if len(breaks):
        end = np.insert(end, breaks, np.nan)
        step = np.insert(step.astype(np.float64), breaks, np.nan)
        duration = np.insert(duration, breaks, np.nan)
    return StepSeries(name=name, end=end, step=step, duration=duration)


def downsample(values: np.ndarray, limit: int) -> np.ndarray:
    """Indices of at most ``limit`` of ``values`` (in order): all of them when they fit, else the smallest and
    the largest of each of ``limit // 2`` equal stretches, so spikes and dips stay visible."""
    n = len(values)
    if n <= limit:
        return np.arange(n)
    buckets = max(1, limit // 2)
    edges = np.linspace(0, n, buckets + 1).astype(np.int64)
    keep = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        if hi <= lo:
            continue
        chunk = values[lo:hi]
        keep += sorted({lo + int(np.argmin(chunk)), lo + int(np.argmax(chunk))})
    return np.asarray(keep, dtype=np.int64)


def checkpoint_rows(directory: Path) -> list[CheckpointRow]:
    """The job's checkpoints, newest step first: every ``step-*`` directory and every one set aside."""
    latest = layout.read_latest(directory)
    rows = []
    for status in layout.scan(directory):
        state = status.state
        if status.complete and latest is not None and latest.step == status.step:
            state = "complete (latest)"
        rows.append(CheckpointRow(step=status.step, state=state, bytes=_size(status.path),
                                  time=_mtime(status.path), detail="; ".join(status.problems)))
    for aside in asides.list_set_aside(directory):
        rows.append(CheckpointRow(step=aside.step, state=f"set aside ({aside.state})", bytes=_size(aside.path),
                                  time=aside.time or _mtime(aside.path), detail=aside.reason))
    return sorted(rows, key=lambda r: r.step, reverse=True)


def _size(path: Path) -> int | None:
    """Bytes of the regular files in ``path``; links are not followed (the tree is the job user's)."""
    try:
        sizes = (p.stat(follow_symlinks=False) for p in path.iterdir())
        return sum(st.st_size for st in sizes if stat.S_ISREG(st.st_mode))
    except OSError:
        return None


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


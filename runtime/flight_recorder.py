"""Collective timing from PyTorch's Flight Recorder.

This is the one module that touches `torch._C._distributed_c10d._dump_fr_trace` and `_dump_nccl_trace`
(private APIs and the only way to read the recorders in-process). `FlightRecorder` reads the ring buffers and
returns only the entries not returned before. Entries are returned once they are retired (completed); a collective
still in flight is returned by a later read. When a ring wrapped between two reads, the overwritten entries are
counted in `missed`. What the entries say (each collective's wait, when a rank arrived at it) is
runtime/collectives.py (`CollectiveReducer`, `ArrivalLog`).

Two recorders, one per kind of backend (torch 2.13's source: FlightRecorder.cpp, ProcessGroupNCCL.cpp).
Gloo (and any backend recording through the generic recorder) writes `FlightRecorder<c10::Event>`, dumped
by `_dump_fr_trace`; ProcessGroupNCCL writes its own `FlightRecorderCUDA` (CUDA events), dumped by
`_dump_nccl_trace`, which only CUDA builds have. The entries have the same fields, but record ids count
per recorder, so each ring is followed on its own (`_Ring`) and each entry returned carries the name of
its recorder under ``"recorder"`` ("gloo" or "nccl"). A job with NCCL and gloo groups reads both; a
recorder with no entries costs a read of about 60 us.

NCCL entries also carry ``state`` ("scheduled", "started", "completed": what the CUDA events said when
the watchdog or a dump last queried them), ``time_discovered_started_ns`` and
``time_discovered_completed_ns`` (wall clock of those queries, not of the GPU events: they lag the GPU by
up to the watchdog's polling period) and, with TORCH_NCCL_ENABLE_TIMING=1, ``duration_ms`` (start to end
event on the GPU).

Environment (tested on torch 2.13 with gloo): TORCH_FR_BUFFER_SIZE alone enables the recorder for gloo
and NCCL alike (it is the number of entries kept; TORCH_NCCL_TRACE_BUFFER_SIZE is the older name, still
read as a fallback). Without it the dump has no entries. TORCH_NCCL_ENABLE_TIMING=1 adds `duration_ms` on
NCCL and is ignored by gloo. The launcher sets `FLIGHT_RECORDER_ENV` for workers.

Ring size: every read dumps and unpickles the whole ring, so its cost grows with TORCH_FR_BUFFER_SIZE, not
with the number of new entries (torch 2.13 on a 2-core VM: about 6-12 us an entry, most of it in the C++
dump with the GIL held; ~1-2 s for 20,000). We keep 256: enough to name a hang's culprit (only the last
few collectives per group matter) and about 1 s of the reference job's collectives (some 240 a second on 4
CPU ranks). `ReadSchedule` reads before the ring wraps while that costs at most `fr_max_duty` of the time
and samples beyond it; entries overwritten before a read are counted (`missed`) and break the arrival chain
there, which the agent handles.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import pickle
import statistics
from collections import deque
from typing import Callable, Mapping

from trainwarden.agent.shared.contract import FLIGHT_RECORDER_ENV
from trainwarden.runtime.collectives import (INTERNAL_GROUP_PREFIX, ArrivalBatch, ArrivalLog, CollectiveReducer,
                                             CollectiveSummary, _internal, _is_nccl)

__all__ = ["FLIGHT_RECORDER_ENV", "INTERNAL_GROUP_PREFIX", "RECORDER_DUMPS", "ArrivalBatch", "ArrivalLog", "CollectiveReducer",
           "CollectiveSummary", "FlightRecorder", "ReadSchedule", "ring_capacity", "torch_recorders"]

log = logging.getLogger(__name__)


RECORDER_DUMPS = {"gloo": "_dump_fr_trace", "nccl": "_dump_nccl_trace"}
"""Recorder name -> the torch._C._distributed_c10d function that dumps it (pickled, torch's format)."""


def _torch_dump(function: str, include_stack_traces: bool) -> bytes:
    from torch._C import _distributed_c10d as c10d  # private: wrapped here and nowhere else

    return getattr(c10d, function)(includeCollectives=True, includeStackTraces=include_stack_traces,
                                   onlyActive=False)


def torch_recorders() -> dict[str, Callable[[bool], bytes]]:
    """The recorders this torch build has: "gloo" always, "nccl" in CUDA builds (`_dump_nccl_trace`)."""
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return {}
    return {name: functools.partial(_torch_dump, function) for name, function in RECORDER_DUMPS.items()
            if hasattr(c10d, function)}


class _Ring:
    """What was returned of one recorder's ring: record ids count per recorder."""

    __slots__ = ("next_id", "returned_ids", "missed", "returned", "unretired")

    def __init__(self) -> None:
        self.next_id = 0  # every record id below this was returned (or missed)
        self.returned_ids: set[int] = set()  # ids at or above next_id already returned
        self.missed = 0
        self.returned = 0
        self.unretired: set[int] = set()  # NCCL ids seen completed by state but not yet retired: held one read

    def take(self, entries: list[dict]) -> list[dict]:
        if not entries:
            return []
        first = entries[0]["record_id"]
        if first > self.next_id:  # the ring wrapped: these were overwritten before we saw them
            self.missed += first - self.next_id - sum(1 for i in self.returned_ids if i < first)
            self.returned_ids = {i for i in self.returned_ids if i >= first}
            self.unretired = {i for i in self.unretired if i >= first}
            self.next_id = first
        new = []
        for entry in entries:
            rid = entry["record_id"]
            if rid < self.next_id or rid in self.returned_ids or not _done(entry):
                continue
            if _awaits_retirement(entry) and rid not in self.unretired:
                self.unretired.add(rid)  # returned by the next read, with its duration once retired
                continue
            self.unretired.discard(rid)
            new.append(entry)
            self.returned_ids.add(rid)
        while self.next_id in self.returned_ids:
            self.returned_ids.discard(self.next_id)
            self.next_id += 1
        self.returned += len(new)
        return new


class FlightRecorder:
    """Reads new Flight Recorder entries from every recorder of the process (module docstring).

    ``recorders`` maps a recorder's name to a callable that returns its pickled trace (tests inject them;
    by default `torch_recorders()`); ``dump`` alone is one recorder named "gloo"."""

    def __init__(self, dump: Callable[[bool], bytes] | None = None, *,
                 recorders: Mapping[str, Callable[[bool], bytes]] | None = None) -> None:
        if recorders is None:
            recorders = {"gloo": dump} if dump is not None else torch_recorders()
        self._recorders = dict(recorders)
        self._rings = {name: _Ring() for name in self._recorders}
        self._failing: set[str] = set()

    @property
    def available(self) -> bool:
        return bool(self._recorders)

    @property
    def recorders(self) -> tuple[str, ...]:
        return tuple(self._recorders)

    @property
    def missed(self) -> int:
        """Entries overwritten before a read returned them (every recorder)."""
        return sum(ring.missed for ring in self._rings.values())

    @property
    def returned(self) -> int:
        """Entries returned so far (every recorder)."""
        return sum(ring.returned for ring in self._rings.values())

    @property
    def complete_below(self) -> dict[str, int]:
        """Per recorder: every record id below this has been returned (or counted as missed)."""
        return {name: ring.next_id for name, ring in self._rings.items()}

    def dump_raw(self, include_stack_traces: bool = False) -> bytes | None:
        """The full trace (torch's pickle bytes) for diagnostics; None when unavailable.

        With one recorder, or one that holds entries, its dump unchanged. With entries in several (NCCL and
        gloo groups in one job), one trace in the same format: the entries of all, each tagged with its
        ``recorder``, the NCCL dump's other fields, ``pg_config`` merged, and the pg ids of entries and
        ``pg_status`` both spelled ``<recorder>/<pg id>`` (pg ids count per backend; the agent's hang verdict
        joins the two on it, agent/watchdog/culprit.py).

        Without stack traces by default: the agent needs sequence ids and states to name a hang's culprit
        (faulthandler gives the stacks), and capturing the Python stack of every entry makes the dump
        about 50x slower (torch 2.13, 2,000 entries: ~0.1 s without, ~5 s with, on a busy 2-core VM)."""
        if not self._recorders:
            return None
        raw = {name: dump(include_stack_traces) for name, dump in self._recorders.items()}
        if len(raw) == 1:
            return next(iter(raw.values()))
        traces = {name: pickle.loads(data) for name, data in raw.items()}
        holding = [name for name, trace in traces.items() if trace.get("entries")]
        if len(holding) <= 1:
            return raw[holding[0] if holding else ("nccl" if "nccl" in raw else next(iter(raw)))]
        merged = dict(traces.get("nccl") or traces[holding[0]])
        merged["entries"] = [dict(entry, recorder=name, pg_id=f"{name}/{entry.get('pg_id')}")
                             for name in holding for entry in traces[name]["entries"]]
        merged["pg_config"] = {k: v for name in holding for k, v in (traces[name].get("pg_config") or {}).items()}
        merged["pg_status"] = {f"{name}/{k}": v for name in holding
                               for k, v in (traces[name].get("pg_status") or {}).items()}
        return pickle.dumps(merged)

    def read_new(self) -> list[dict]:
        """Retired entries not returned before, each recorder's oldest first, tagged with ``"recorder"``.
        Empty when no recorder is available. A recorder whose dump fails is skipped (and logged once)."""
        new: list[dict] = []
        for name, trace in self._traces():
            entries = sorted(trace.get("entries") or (), key=lambda e: e["record_id"])
            for entry in entries:
                entry["recorder"] = name
            new.extend(e for e in self._rings[name].take(entries) if not _internal(e))
        return new

    def _traces(self):
        """Each recorder's name and unpickled trace, without stack traces; a recorder whose dump fails is skipped
        (and logged once, until it works again)."""
        for name, dump in self._recorders.items():
            try:
                trace = pickle.loads(dump(False))
            except Exception as exc:
                if name not in self._failing:
                    self._failing.add(name)
                    log.warning("flight recorder %s: dump failed: %s", name, exc)
                continue
            self._failing.discard(name)
            yield name, trace

    def oldest_pending_ns(self, thread_id: int | None = None) -> int | None:
        """Wall-clock enqueue time (ns) of the oldest collective in the rings that has not completed (neither
        retired nor seen completed), of `thread_id` where an entry names its thread; None when there is none,
        or no recorder. One dump of every ring: the training thread's sender calls it only while that thread
        has stayed inside one call (agent_client.py)."""
        thread = None if thread_id is None else str(thread_id)
        oldest = None
        for _, trace in self._traces():
            for entry in trace.get("entries") or ():
                created = entry.get("time_created_ns")
                if not created or _done(entry) or _internal(entry):
                    continue
                if thread is not None and str(entry.get("thread_id", thread)) != thread:
                    continue
                oldest = int(created) if oldest is None else min(oldest, int(created))
        return oldest


def ring_capacity(env: "dict[str, str] | os._Environ[str]" = os.environ) -> int | None:
    """Entries the recorder keeps (TORCH_FR_BUFFER_SIZE, or its older name); None when unset or unreadable."""
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        value = env.get(name)
        if value:
            try:
                return max(0, int(value))
            except ValueError:
                return None
    return None


GRID_S = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0)
"""The read periods a schedule picks from: ranks that pick the same one read at the same instants."""


class ReadSchedule:
    """When to read the Flight Recorder next: as rarely as coverage allows, on a grid the node's ranks share.

    A read dumps the whole ring, so it costs time in proportion to the ring's size whatever is new (with the
    GIL held, the training thread's time). What a read must not do is come so late that the ring wrapped:
    the entries in between are lost to the straggler detector. So the period is

    * at most ``interval_s`` (the detectors' latency: arrivals reach the agent within a period; the agent
      lengthens it while no detector is near a decision, `set_interval`),
    * shorter when the collectives would fill ``fill_margin`` of the ring sooner (``capacity`` over the
      highest recent rate of new entries),
    * but never shorter than ``min_interval_s`` nor than the median cost of recent reads over ``max_duty``
      (a job that enqueues collectives faster than that is *sampled*: each read sees the ring's last
      ``capacity`` entries, and `FlightRecorder.missed` counts the rest);

    rounded to a period of `GRID_S` (down when coverage bounds it, up when cost does), and each read falls
    on a multiple of that period in wall-clock time. The node's ranks run at the same rate and share the
    clock, so they read at the same instants and a sampled window holds the same collectives on every rank:
    the arrivals still match across ranks.
    """

    def __init__(self, *, interval_s: float, min_interval_s: float, max_duty: float, capacity: int | None,
                 fill_margin: float = 0.75) -> None:
        self.interval_s = interval_s
        self.min_interval_s = min(min_interval_s, interval_s)
        self.max_duty = max_duty
        self.capacity = capacity
        self.fill_margin = fill_margin
        self.period_s = interval_s
        self._costs: deque[float] = deque(maxlen=5)
        self._rates: deque[float] = deque(maxlen=3)
        self._last_read: float | None = None

    def next_read(self, now: float, *, cost_s: float | None = None, entries: int = 0) -> float:
        """After a read at wall time ``now`` that cost ``cost_s`` seconds (CPU) and found ``entries`` new
        (or overwritten) ones: the wall time of the next read. Without ``cost_s``: the first one."""
        if cost_s is not None:
            self._costs.append(cost_s)
            if self._last_read is not None and now > self._last_read:
                self._rates.append(entries / (now - self._last_read))
        self._last_read = now  # (the first call: when counting began)
        return self._next_instant(now)

    def set_interval(self, interval_s: float, now: float) -> float:
        """Change the longest period (the agent's read pace) at wall time ``now``: the wall time of the next
        read under it, on its grid, so that ranks told at slightly different instants still read together.
        The caller keeps an earlier read it already planned."""
        self.interval_s = max(interval_s, self.min_interval_s)
        return self._next_instant(now)

    def _next_instant(self, now: float) -> float:
        upper = self.interval_s
        if self.capacity and self._rates and max(self._rates) > 0:
            upper = min(upper, self.fill_margin * self.capacity / max(self._rates))
        lower = self.min_interval_s
        if self._costs:
            lower = max(lower, statistics.median(self._costs) / self.max_duty)
        fits = [g for g in GRID_S if lower <= g <= upper]
        # the longest grid period coverage allows; when none fits (coverage costs more than the budget: the
        # ring is sampled), the shortest the budget allows
        period = fits[-1] if fits else next((g for g in GRID_S if g >= lower), lower)
        self.period_s = period
        return (math.floor(now / period) + 1) * period


def _done(entry: dict) -> bool:
    return bool(entry.get("retired")) or entry.get("state") == "completed"


def _awaits_retirement(entry: dict) -> bool:
    """An NCCL entry a dump's own event query saw completed before the watchdog retired it. Retirement is
    what adds ``duration_ms`` (with timing on), within the watchdog's next poll (100 ms in torch), so the
    reader holds such an entry for one read. Seen on an H100 (torch 2.11, NCCL 2.28): read at once, the
    last entries of a burst came without durations."""
    return _is_nccl(entry) and not entry.get("retired") and entry.get("state") == "completed"

"""What Flight Recorder entries say about a rank's collectives (runtime/flight_recorder.py reads them).

- `CollectiveReducer` folds entries into cumulative per (process_group, op) totals: count, wait seconds and
  the last collective sequence id. It is plain Python, tested on recorded sample dicts.
- `ArrivalLog` picks the training thread's collectives out of each read, (group, sequence id, arrival time) in
  record order, for the agent to match across ranks (agent/telemetry/arrivals.py): on gloo that, not the wait
  estimate below, is what straggler detection uses.

What "wait" means:

- NCCL with TORCH_NCCL_ENABLE_TIMING=1: entries carry `duration_ms`, the measured time of the collective
  kernel, which is dominated by waiting for the slowest peer. wait = duration.
- NCCL without timing: the time between the discovered start and completion (coarse: both are query
  times), or zero when the start was never seen. The enqueue-gap estimate below means nothing on CUDA,
  where the CPU enqueues ahead of the GPU.
- gloo: entries carry only `time_created_ns`, the wall-clock enqueue time.
  Blocking gloo collectives return when they are complete, so the next thing the rank does (enqueue
  another collective, or end the step) cannot start before. We estimate each collective's wait as the
  time from its enqueue to the earlier of (the next enqueue on the same thread, the end of the step that
  contains it). This is an upper bound: host compute between a collective's completion and the next
  enqueue is counted as wait. It is accurate when collectives end the step or run back to back (data
  parallel gradient sync, the slow-rank case: peers of a slow rank block in the all-reduce until it
  arrives), and overestimates wait for tensor parallel layers that compute between collectives.
  Asynchronous collectives (`async_op=True`) are waited for in `work.wait()`, which the recorder does not
  see: their estimate is the gap to the next enqueue, which says little. Collectives enqueued outside any
  step are counted with zero wait (compute = step − wait only concerns steps).

Arrival times (`ArrivalLog`): on gloo, the enqueue time. On NCCL the enqueue is the CPU's, which runs
ahead of the GPU, so an entry with a duration arrives at ``time_discovered_completed_ns - duration_ms``:
the kernel's start on the wall clock, late by the completion's discovery lag (runtime/flight_recorder.py); without a
duration, the enqueue time (then a GPU straggler is not seen in arrivals, only in the hang verdict).
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

__all__ = ["INTERNAL_GROUP_PREFIX", "ArrivalBatch", "ArrivalLog", "CollectiveReducer", "CollectiveSummary"]

log = logging.getLogger(__name__)

_MAX_PENDING = 50_000
_MAX_STEPS = 4096

INTERNAL_GROUP_PREFIX = "trainwarden-"
"""The description of every process group trainwarden makes for its own traffic (``dist.new_group(group_desc=)``)."""


@dataclass(frozen=True, kw_only=True)
class CollectiveSummary:
    """Cumulative totals for one (process group, op) in this process."""

    process_group: str
    """Process group name (or its id when unnamed)."""
    op: str
    """Collective, without the backend prefix: "all_reduce"."""
    count: int
    """Collectives completed."""
    wait_seconds: float
    """Measured (NCCL duration) or estimated (gloo) seconds, see the module docstring."""
    last_seq_id: int
    """Highest collective sequence id seen in the group."""


def _is_nccl(entry: dict) -> bool:
    return entry.get("recorder") == "nccl" or str(entry.get("profiling_name") or "").startswith("nccl:")


def _discovered_seconds(entry: dict) -> float:
    """NCCL without timing: from the discovered start to the discovered completion (query times)."""
    started, completed = entry.get("time_discovered_started_ns"), entry.get("time_discovered_completed_ns")
    if not started or not completed or completed < started:
        return 0.0
    return (int(completed) - int(started)) / 1e9


def _arrival_ns(entry: dict) -> int:
    """When the rank reached the collective, on the wall clock (module docstring: Arrival times)."""
    duration_ms, completed = entry.get("duration_ms"), entry.get("time_discovered_completed_ns")
    if _is_nccl(entry) and duration_ms is not None and completed:
        return int(completed) - int(float(duration_ms) * 1e6)
    return int(entry["time_created_ns"])


def _group_name(entry: dict) -> str:
    pg = entry.get("process_group")
    if isinstance(pg, (tuple, list)) and pg:
        if len(pg) > 1 and pg[1] not in ("", "undefined"):
            return str(pg[1])
        return f"pg{pg[0]}" if str(pg[0]).isdigit() else str(pg[0])  # a group made outside init_process_group
    return f"pg{entry.get('pg_id', '?')}"


def _internal(entry: dict) -> bool:
    """An entry of trainwarden's own background traffic (the peer copy of memory snapshots: runtime/checkpoint/memory_peer.py),
    never the job's collectives: left out of what is read."""
    return _group_name(entry).startswith(INTERNAL_GROUP_PREFIX)


def _group_id(entry: dict) -> str:
    """The group's unique name (what torch's registry knows it by), not its description."""
    pg = entry.get("process_group")
    if isinstance(pg, (tuple, list)) and pg:
        return str(pg[0])
    return str(entry.get("pg_id", "?"))


def _op_name(entry: dict) -> str:
    name = str(entry.get("profiling_name") or "unknown")
    return name.split(":", 1)[1] if ":" in name else name


class CollectiveReducer:
    """Folds Flight Recorder entries and step boundaries into cumulative per (group, op) totals."""

    def __init__(self) -> None:
        self._totals: dict[tuple[str, str], list] = {}  # -> [count, wait_seconds, last_seq_id]
        self._steps: deque[tuple[int, int]] = deque(maxlen=_MAX_STEPS)  # (start_ns, end_ns), wall clock
        self._pending: list[dict] = []  # gloo entries whose step has not ended yet, by time_created_ns
        self.has_durations = False

    def add_step(self, start_ns: int, end_ns: int) -> None:
        """A finished step's wall-clock bounds (steps arrive in order)."""
        self._steps.append((int(start_ns), int(end_ns)))

    def add_entries(self, entries: Iterable[dict]) -> None:
        for entry in entries:
            duration_ms = entry.get("duration_ms")
            if duration_ms is not None:
                self.has_durations = True
                self._add(entry, max(0.0, float(duration_ms)) / 1000.0)
            elif _is_nccl(entry):
                self._add(entry, _discovered_seconds(entry))
            else:
                self._pending.append(entry)
        self._pending.sort(key=lambda e: e.get("time_created_ns") or 0)
        self._resolve()

    def summaries(self) -> list[CollectiveSummary]:
        self._resolve()
        return [CollectiveSummary(process_group=pg, op=op, count=c, wait_seconds=w, last_seq_id=s)
                for (pg, op), (c, w, s) in sorted(self._totals.items())]

    def _add(self, entry: dict, wait: float) -> None:
        key = (_group_name(entry), _op_name(entry))
        totals = self._totals.setdefault(key, [0, 0.0, -1])
        totals[0] += 1
        totals[1] += wait
        totals[2] = max(totals[2], int(entry.get("collective_seq_id") or 0))

    def _resolve(self) -> None:
        if not self._pending:
            return
        starts = [s for s, _ in self._steps]
        last_end = self._steps[-1][1] if self._steps else None
        next_on_thread: dict[str, int] = {}
        keep: list[dict] = []
        # newest first, so each entry knows the next enqueue on its thread
        for entry in reversed(self._pending):
            created = int(entry.get("time_created_ns") or 0)
            thread = str(entry.get("thread_id", ""))
            following = next_on_thread.get(thread)
            next_on_thread[thread] = created
            if last_end is None or created > last_end:
                keep.append(entry)  # its step has not finished (or no step seen yet)
                continue
            i = bisect.bisect_right(starts, created) - 1
            if i < 0 or created > self._steps[i][1]:
                self._add(entry, 0.0)  # outside every step
                continue
            boundary = self._steps[i][1] if following is None else min(following, self._steps[i][1])
            self._add(entry, max(0, boundary - created) / 1e9)
        keep.reverse()
        if len(keep) > _MAX_PENDING:  # steps are not being recorded: count the oldest without a wait
            for entry in keep[:-_MAX_PENDING]:
                self._add(entry, 0.0)
            keep = keep[-_MAX_PENDING:]
        self._pending = keep


@dataclass(frozen=True, kw_only=True)
class ArrivalBatch:
    """The training thread's collectives since the last batch, oldest first."""

    arrivals: tuple[tuple[str, int, int, str], ...]
    """(process group name, collective sequence id, wall-clock enqueue ns, op)."""
    continues: bool
    """True when the first arrival directly follows the previous batch's last (nothing missed between)."""
    members: dict[str, tuple[int, ...]]
    """Global ranks of the groups named for the first time in this batch (when they can be resolved)."""


class ArrivalLog:
    """Turns Flight Recorder entries into the training thread's collective arrivals for the agent.

    The agent matches one collective (process group, sequence id) across the node's ranks: the last rank
    to arrive is the one the others waited for (agent/telemetry/arrivals.py). Only the training thread's
    collectives count (checkpoint writers run theirs on other threads), point-to-point entries are left
    out (no sequence id that matches across ranks), and entries are released in record order: one still
    in flight holds back those after it, so the agent sees every arrival of a stretch exactly once. Each
    recorder's entries are released in its own record order; a batch holding both (NCCL and gloo groups)
    is merged by enqueue time, the training thread's program order.
    `members` resolves a group name to its ranks (injected in tests; torch's group registry otherwise).
    """

    def __init__(self, thread_id: int, members: Callable[[str], tuple[int, ...] | None] | None = None) -> None:
        self._thread = str(thread_id)
        self._members = members or _torch_group_members
        self._held: list[dict] = []
        self._described: set[str] = set()
        self._missed = 0
        self._sent_any = False
        self._broken = True

    def add(self, entries: Iterable[dict], *, complete_below: int | Mapping[str, int], missed: int) -> ArrivalBatch:
        """Take the entries of one read; return the arrivals that can be released. ``complete_below``: the
        reader's `FlightRecorder.complete_below` (per recorder; one int applies to every recorder)."""

        def below(entry: dict) -> bool:
            if isinstance(complete_below, int):
                return entry["record_id"] < complete_below
            return entry["record_id"] < complete_below.get(entry.get("recorder", ""), 0)

        if missed != self._missed:  # entries were lost: the chain of arrivals has a gap
            self._missed = missed
            self._broken = True
            self._held = [e for e in self._held if not below(e)]
        self._held.extend(e for e in entries
                          if str(e.get("thread_id", "")) == self._thread and not e.get("is_p2p")
                          and e.get("time_created_ns") is not None)
        ready = [e for e in self._held if below(e)]
        self._held = [e for e in self._held if not below(e)]
        ready.sort(key=lambda e: (e.get("recorder", ""), e["record_id"]))
        if len({e.get("recorder", "") for e in ready}) > 1:
            ready.sort(key=lambda e: int(e["time_created_ns"]))  # stable: record order within a recorder
        arrivals = tuple((_group_id(e), int(e.get("collective_seq_id") or 0), _arrival_ns(e), _op_name(e))
                         for e in ready)
        members: dict[str, tuple[int, ...]] = {}
        for name in {a[0] for a in arrivals} - self._described:
            self._described.add(name)
            ranks = self._resolve(name)
            if ranks:
                members[name] = ranks
        continues = self._sent_any and not self._broken
        if arrivals:
            self._sent_any, self._broken = True, False
        return ArrivalBatch(arrivals=arrivals, continues=continues, members=members)

    def _resolve(self, name: str) -> tuple[int, ...] | None:
        try:
            return self._members(name)
        except Exception as exc:  # a torch-internal lookup: never fail the sender over it
            log.debug("cannot resolve the ranks of process group %s: %s", name, exc)
            return None


def _torch_group_members(name: str) -> tuple[int, ...] | None:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world  # private registry: group object -> name

    for pg, pg_name in list(_world.pg_names.items()):
        if pg_name == name:
            return tuple(int(r) for r in dist.get_process_group_ranks(pg))
    return None

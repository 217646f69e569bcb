"""Naming the culprit of a hang from the ranks' collective positions and stacks.

When a job hangs, every rank that is inside a collective waits for a peer that never entered it. The
Flight Recorder counts collectives per process group (the sequence id), so the culprit is the rank whose
sequence id lags the others' in some process group: the others entered collective N, it is still at N-1.

The input is one `RankEvidence` per rank, read from the diagnostics the ranks wrote on request
(`read_diagnostics`: ``rank<R>.fr``, the Flight Recorder dump, and ``rank<R>.stacks``, faulthandler's
stacks of every thread). Ranks that could not answer (stopped, dead, disconnected) carry that status and
no positions. `name_culprit` is a pure function of that evidence:

- For each process group (keyed by its c10d name, which is the same on every member; point-to-point
  sequences are a separate key ``<name>/p2p``), a member that answered and whose last sequence id is below
  the group's highest lags. The collective the others wait in is the one at the highest id.
- A lagging rank that is itself waiting inside an unfinished collective of another group is blocked, not
  the cause (pipeline and tensor-parallel groups chain waits). So is one whose training thread waits in a
  point-to-point call (`P2P_WAITS`): gloo's recorder has no entry for send/recv, so its stack is the evidence. A lag in a group whose leaders all answered and
  none waits in the collective at the top holds no one up (it completed without the laggard: a pipeline's send,
  while the laggard waits for its receive) and names no one either. The culprits are the lagging ranks that are
  not inside any collective: they stopped outside, in compute, I/O or a deadlock of their own.
- If no rank lags, the verdict says so ("every rank is inside the same collective") and lists the ranks
  that did not answer. It never guesses.

`process_state(pid)` tells why a local rank did not answer (stopped, dead, or alive but silent).

Dumps are parsed with an unpickler that refuses every global: a Flight Recorder trace holds only dicts,
lists, strings and numbers, and the agent must not run code from files that workers wrote.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import psutil

from trainwarden.agent.shared.contract import MAIN_THREAD_HEADER, stacks_file, trace_file
from trainwarden.agent.shared.regular_file import NotARegularFile, read_regular

log = logging.getLogger(__name__)

__all__ = ["ANSWERED", "GroupPosition", "Lag", "RankEvidence", "Verdict", "give_to_writers", "main_thread_frames",
           "name_culprit", "positions_from_trace", "process_state", "read_diagnostics"]

ANSWERED = "answered"
_FRAME_RE = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>.*)$')
_THREAD_RE = re.compile(r"^(Thread|Current thread) (0x[0-9a-fA-F]+)")
_MAIN_THREAD_RE = re.compile("^" + re.escape(MAIN_THREAD_HEADER.partition("{")[0]) + r"([0-9a-fA-F]+)")


P2P_WAITS = frozenset({
    ("torch/distributed/pipelining/schedules.py", "_wait_batch_p2p"),
    ("torch/distributed/distributed_c10d.py", "recv"),
    ("torch/distributed/distributed_c10d.py", "send"),
    ("torch/distributed/distributed_c10d.py", "recv_object_list"),
    ("torch/distributed/distributed_c10d.py", "send_object_list"),
})
"""(file suffix, function) of the training thread's top frame that mean it waits for a point-to-point peer."""
_STACK_FRAME_RE = re.compile(r"^(?P<func>\S+) \((?P<file>.*):\d+\)$")


def waits_in_p2p(stack: tuple[str, ...]) -> bool:
    """The top frame (``"func (file:line)"``, as `main_thread_frames` gives it) is a point-to-point wait."""
    m = _STACK_FRAME_RE.match(stack[0]) if stack else None
    return bool(m) and any(m["file"].endswith(suffix) and m["func"] == func for suffix, func in P2P_WAITS)


@dataclass(frozen=True, kw_only=True)
class GroupPosition:
    """Where one rank stands in one process group."""

    group: str
    """Process group key: the c10d group name (same on every member), "/p2p" appended for send/recv."""
    desc: str
    """The group's description, e.g. "tp" or "default_pg"."""
    seq: int
    """Sequence id of the last collective the rank entered in the group."""
    op: str
    """That collective's op, e.g. "all_reduce"."""
    in_flight: bool
    """The rank is inside that collective (entered, not finished)."""


@dataclass(frozen=True, kw_only=True)
class RankEvidence:
    """What is known about one rank at the time of a hang."""

    rank: int
    status: str = ANSWERED
    """"answered", or why not: "stopped", "dead", "disconnected", "no_answer"."""
    positions: Mapping[str, GroupPosition] = field(default_factory=dict)
    stack: tuple[str, ...] = ()
    """Top frames of the training thread, most recent first."""
    recorded: bool = False
    """Its Flight Recorder dump was read (``positions`` empty then: the recorder held no collective)."""


@dataclass(frozen=True, kw_only=True)
class Lag:
    """A rank behind its peers in one process group."""

    rank: int
    group: str
    desc: str
    seq: int
    """The lagging rank's last sequence id in the group."""
    peer_seq: int
    """The highest sequence id in the group: the collective the others are in."""
    op: str
    """The op of that collective."""
    waiting: tuple[int, ...]
    """Ranks inside that collective."""
    blocked: bool
    """The lagging rank is itself inside an unfinished collective elsewhere (a consequence, not the cause)."""


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """The culprit(s) of a hang, or why none can be named."""

    culprits: tuple[int, ...]
    summary: str
    lags: tuple[Lag, ...] = ()
    unresponsive: Mapping[int, str] = field(default_factory=dict)
    stacks: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    """Top frames of the culprits (when they answered)."""

    def to_dict(self) -> dict:
        return {
            "culprits": list(self.culprits), "summary": self.summary,
            "lags": [{"rank": g.rank, "group": g.group, "desc": g.desc, "seq": g.seq, "peer_seq": g.peer_seq,
                      "op": g.op, "waiting": list(g.waiting), "blocked": g.blocked} for g in self.lags],
            "unresponsive": {str(r): s for r, s in sorted(self.unresponsive.items())},
            "stacks": {str(r): list(s) for r, s in sorted(self.stacks.items())},
        }


def name_culprit(evidence: Mapping[int, RankEvidence]) -> Verdict:
    """Name the rank(s) whose collective sequence lags their peers' (see the module docstring)."""
    answered = {r: e for r, e in evidence.items() if e.status == ANSWERED}
    unresponsive = {r: e.status for r, e in sorted(evidence.items()) if e.status != ANSWERED}
    silent = f"; ranks that did not answer: {_describe(unresponsive)}" if unresponsive else ""
    if not any(e.positions for e in answered.values()):
        if any(e.recorded for e in answered.values()):  # gloo's recorder has no entry for send/recv
            why = (f"the Flight Recorder dumps of the {len(answered)} answering ranks hold no collective (none "
                   f"entered yet, or only send/recv, which gloo does not record: a pipeline schedule's traffic)")
        else:
            why = (f"no Flight Recorder dump arrived from the {len(answered)} answering ranks (recorder off, i.e. "
                   f"no TORCH_FR_BUFFER_SIZE, or the dump took longer than the wait)")
        return Verdict(culprits=(), unresponsive=unresponsive, summary=f"no collective positions: {why}{silent}")
    in_flight = {r for r, e in answered.items() if any(p.in_flight for p in e.positions.values())}
    blocked = in_flight | {r for r, e in answered.items() if waits_in_p2p(e.stack)}
    groups: dict[str, dict[int, GroupPosition]] = {}
    for rank, e in answered.items():
        for key, pos in e.positions.items():
            groups.setdefault(key, {})[rank] = pos
    lags: list[Lag] = []
    for key, members in sorted(groups.items()):
        top = max(p.seq for p in members.values())
        leaders = [r for r, p in sorted(members.items()) if p.seq == top]
        lead = members[leaders[0]]
        waiting = tuple(r for r in leaders if members[r].in_flight)
        for rank, pos in sorted(members.items()):
            if pos.seq < top:
                lags.append(Lag(rank=rank, group=key, desc=lead.desc, seq=pos.seq, peer_seq=top, op=lead.op,
                                waiting=waiting, blocked=rank in blocked))
    # a lag holds someone up only where a rank waits in the collective it never entered: when the group's leaders
    # all answered and none is inside it, it completed without the laggard (a pipeline's send, which gloo records
    # as an op of its own), and the laggard is where it is for a reason elsewhere
    culprits = tuple(sorted({g.rank for g in lags if not g.blocked and g.waiting}))
    stacks = {r: answered[r].stack for r in culprits if answered[r].stack}
    if culprits:
        parts = []
        for rank in culprits:
            g = next(g for g in lags if g.rank == rank and not g.blocked and g.waiting)
            where = f" at {answered[rank].stack[0]}" if answered[rank].stack else ""
            parts.append(f"rank {rank} never entered {g.op} #{g.peer_seq} of group {g.desc or g.group} "
                         f"(its last is #{g.seq}; ranks {_ranks(g.waiting)} wait in it){where}")
        summary = "; ".join(parts) + silent
    elif unresponsive and blocked == set(answered):
        # every answering rank waits (in a collective or for a point-to-point peer): the ranks that could not answer
        # are the ones that never entered the collective the others wait in
        culprits = tuple(sorted(unresponsive))
        summary = _unresponsive_summary(unresponsive, answered, in_flight)
    elif lags:
        summary = (f"ranks {_ranks(sorted({g.rank for g in lags}))} lag but each waits inside another "
                   f"collective or holds up no answering rank: the cause is outside the answering ranks{silent}")
    elif in_flight == set(answered):
        summary = f"no lagging rank: every rank is inside the same collective{silent}"
    else:
        summary = (f"no lagging rank: all answering ranks are at the same collective positions, "
                   f"ranks {_ranks(sorted(set(answered) - in_flight))} outside any collective{silent}")
    return Verdict(culprits=culprits, summary=summary, lags=tuple(lags), unresponsive=unresponsive,
                   stacks=stacks)


_WHY = {
    "stopped": "is stopped (SIGSTOP, a debugger or a frozen container holds it)",
    "dead": "is dead (its process is gone)",
    "disconnected": "lost its telemetry stream (it died or wedged before it could answer)",
    "no_answer": "is alive but did not answer (stuck in native code, or holding the GIL)",
}


def _unresponsive_summary(unresponsive: Mapping[int, str], answered: Mapping[int, RankEvidence],
                          in_flight: set[int]) -> str:
    """"rank 2 is stopped (...) and never entered all_reduce #41 of group default_pg, which ranks 0,1,3 wait in"."""
    waits: dict[tuple[str, int], list[tuple[int, GroupPosition]]] = {}
    for rank in sorted(in_flight):
        for pos in answered[rank].positions.values():
            if pos.in_flight:
                waits.setdefault((pos.group, pos.seq), []).append((rank, pos))
    where = ""
    if waits:
        (_, seq), members = max(waits.items(), key=lambda kv: (len(kv[1]), kv[0][1]))
        pos = members[0][1]
        where = (f" and never entered {pos.op} #{seq} of group {pos.desc or pos.group}, which ranks "
                 f"{_ranks(r for r, _ in members)} wait in")
    parts = [f"rank {rank} {_WHY.get(status, f'did not answer ({status})')}" for rank, status in
             sorted(unresponsive.items())]
    return "; ".join(parts) + where


def positions_from_trace(trace: Mapping) -> dict[str, GroupPosition]:
    """Per process group, the last collective a rank entered, from a Flight Recorder trace dict."""
    best: dict[str, GroupPosition] = {}
    names: dict[str, tuple[str, str]] = {}  # pg_id (a per-process ordinal) -> (name, desc)
    for entry in trace.get("entries") or ():
        pg = entry.get("process_group") or (str(entry.get("pg_id", "?")), "")
        name, desc = str(pg[0]), str(pg[1]) if len(pg) > 1 else ""
        names[str(entry.get("pg_id"))] = (name, desc)
        p2p = bool(entry.get("is_p2p"))
        key = f"{name}/p2p" if p2p else name
        seq = int(entry.get("p2p_seq_id" if p2p else "collective_seq_id") or 0)
        op = str(entry.get("profiling_name") or "unknown").split(":", 1)[-1]
        in_flight = not entry.get("retired") and entry.get("state") != "completed"
        if key not in best or seq >= best[key].seq:
            best[key] = GroupPosition(group=key, desc=desc, seq=seq, op=op, in_flight=in_flight)
    # pg_status is keyed by pg_id; it can only be used for groups whose id an entry maps to a name
    for pg_id, status in (trace.get("pg_status") or {}).items():
        enqueued = int(status.get("last_enqueued_collective", -1))
        if str(pg_id) not in names:
            continue
        name, desc = names[str(pg_id)]
        if name not in best or best[name].seq < enqueued:
            best[name] = GroupPosition(group=name, desc=desc, seq=enqueued, op="unknown",
                                       in_flight=enqueued > int(status.get("last_completed_collective", -1)))
    return best


def main_thread_frames(stacks_text: str, limit: int = 8) -> tuple[str, ...]:
    """Top frames of the training thread from faulthandler's all-threads dump.

    The runtime writes ``# trainwarden main_thread=0x...`` above the dump; that thread is the training
    thread. Without the header (a dump from elsewhere), the last listed thread is taken: faulthandler lists
    threads newest first. The thread that wrote the dump is marked "Current thread" and never chosen.
    """
    main_ident = None
    blocks: list[tuple[int | None, bool, list[str]]] = []
    for line in stacks_text.splitlines():
        header = _MAIN_THREAD_RE.match(line)
        if header:
            main_ident = int(header.group(1), 16)
            continue
        thread = _THREAD_RE.match(line)
        if thread:
            blocks.append((int(thread.group(2), 16), thread.group(1) == "Current thread", []))
            continue
        m = _FRAME_RE.match(line)
        if m and blocks:
            blocks[-1][2].append(f"{m['func']} ({m['file']}:{m['line']})")
    candidates = [(ident, frames) for ident, current, frames in blocks if not current and frames]
    if main_ident is not None:
        for ident, frames in candidates:
            if ident == main_ident:
                return tuple(frames[:limit])
    return tuple(candidates[-1][1][:limit]) if candidates else ()


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refusing {module}.{name}: a Flight Recorder dump holds plain data only")


MAX_TRACE_BYTES = 64 * 1024 * 1024
"""A Flight Recorder dump larger than this is not read (a worker must not make the agent load gigabytes)."""
MAX_STACKS_BYTES = 4 * 1024 * 1024


def give_to_writers(directory: str | Path, uid: int | None) -> None:
    """Let the job's workers write their dumps into `directory`, a fresh directory the agent made for one hang:
    when the agent is root and the job's streams were verified as another uid, that uid gets the directory (by
    descriptor, never through a link). Its parent stays the agent's, so the workers cannot move the directory or
    put a link in its place; what they put in it is read by `read_diagnostics`, which trusts none of it."""
    if uid is None or uid == os.geteuid() or os.geteuid() != 0:
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        os.fchown(fd, uid, -1)
        os.fchmod(fd, 0o755)
    finally:
        os.close(fd)


def read_diagnostics(directory: str | Path, ranks: Iterable[int], *, max_trace_bytes: int = MAX_TRACE_BYTES,
                     uid: int | None = None) -> dict[int, RankEvidence]:
    """Evidence of the ranks whose diagnostics are in `directory` (ranks without any file are left out).

    A rank answered when its ``.fr`` dump parses, or when only ``.stacks`` exist (no Flight Recorder). A dump
    over ``max_trace_bytes`` is skipped with a warning; stacks are read up to ``MAX_STACKS_BYTES``.

    The workers write these files, and the reader may be root: `directory` is opened without following a link
    (``O_NOFOLLOW|O_DIRECTORY``) and each file relative to it with ``O_NOFOLLOW|O_NONBLOCK``; only a regular file
    within its bound, and with ``uid`` only one owned by that uid (the job's), is read. A link, a FIFO, a device or
    another uid's file counts as no file: it never blocks the watchdog nor makes it read a file the workers name.
    """
    directory = Path(directory)
    found: dict[int, RankEvidence] = {}
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        log.warning("not reading the diagnostics in %s: %s (a directory of its own is expected, never a link)",
                    directory, exc)
        return found
    try:
        for rank in ranks:
            positions: dict[str, GroupPosition] = {}
            try:
                trace = _NoGlobals(io.BytesIO(read_regular(trace_file(rank), max_trace_bytes, dir_fd=dir_fd,
                                                           uid=uid))).load()
                positions = positions_from_trace(trace) if isinstance(trace, dict) else {}
                fr_ok = True
            except NotARegularFile as exc:
                log.warning("not reading rank %d's Flight Recorder dump: %s", rank, exc)
                fr_ok = False
            except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError):
                fr_ok = False
            try:
                text = read_regular(stacks_file(rank), MAX_STACKS_BYTES, dir_fd=dir_fd, uid=uid)
                stack = main_thread_frames(text.decode("utf-8", "replace"))
            except OSError as exc:
                if isinstance(exc, NotARegularFile):
                    log.warning("not reading rank %d's stacks: %s", rank, exc)
                if not fr_ok:
                    continue
                stack = ()
            found[rank] = RankEvidence(rank=rank, positions=positions, stack=stack, recorded=fr_ok)
    finally:
        os.close(dir_fd)
    return found


def process_state(pid: int) -> str:
    """Why a local worker did not answer: "stopped", "dead" or "no_answer" (alive but silent)."""
    try:
        status = psutil.Process(pid).status()
    except (psutil.NoSuchProcess, ValueError):
        return "dead"
    except psutil.AccessDenied:
        return "no_answer"
    if status == psutil.STATUS_STOPPED or status == psutil.STATUS_TRACING_STOP:
        return "stopped"
    return "dead" if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) else "no_answer"


def process_io_bytes(pid: int) -> int | None:
    """Bytes the process has read and written so far (/proc/<pid>/io: through read/write calls, and at the
    storage layer, which also sees mmap'd reads); None when it cannot be read (gone, not ours to read)."""
    try:
        io = psutil.Process(pid).io_counters()
    except (psutil.Error, OSError, ValueError, AttributeError):
        return None
    return io.read_chars + io.write_chars + io.read_bytes + io.write_bytes


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user and system, every thread) the process and its descendants have used: its own, its
    children's that it has reaped, and each live descendant's (a DataLoader's workers compute while the rank
    waits for them). None when the process cannot be read; a descendant that cannot be is left out."""
    total = _cpu_with_reaped(pid)
    if total is None:
        return None
    for child in _descendants(pid):
        total += _cpu_with_reaped(child) or 0.0
    return total


def process_own_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user and system, every thread) the process itself has used, not its children's; None when
    it cannot be read."""
    try:
        t = psutil.Process(pid).cpu_times()
    except (psutil.Error, OSError, ValueError):
        return None
    return t.user + t.system


def _cpu_with_reaped(pid: int) -> float | None:
    try:
        t = psutil.Process(pid).cpu_times()
    except (psutil.Error, OSError, ValueError):
        return None
    return t.user + t.system + t.children_user + t.children_system


def _descendants(pid: int, limit: int = 256) -> list[int]:
    """The live descendants of ``pid``, from /proc/<pid>/task/<tid>/children (a few reads per process, not a
    scan of every process on the node); at most ``limit`` of them, nothing where /proc does not say."""
    found: list[int] = []
    todo = [pid]
    while todo and len(found) < limit:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                continue
            found.extend(children)
            todo.extend(children)
    return found[:limit]


def _ranks(ranks: Iterable[int]) -> str:
    return ",".join(str(r) for r in ranks) or "none"


def _describe(statuses: Mapping[int, str]) -> str:
    return ", ".join(f"{r} ({s})" for r, s in sorted(statuses.items()))

"""Per-step snapshots of a rank's state in host memory that outlives the worker: ``MemorySnapshots``.

A restart after a crash or a hang should lose at most the step in flight, not everything since the last disk
checkpoint, and should not read the disk back. So after every step each rank copies what it owns of the state
(the local shards of DTensors, its plain tensors, the small Python values) into a file of its own in the node
agent's shared-memory directory (``MEMORY_DIR_ENV``; layout in ``agent/shared/snapshot_layout.py``). The agent owns
that directory: it outlives the worker processes, not the agent. Each finished file is reported (checkpoint stage
``snapshot``); the agent knows a step as snapshotted once every rank of the world size reported it, and tells the
restoring rank 0 (``Session.memory_record``). The ``Checkpointer`` uses a snapshot only when it is at least as new
as every checkpoint the job committed to disk, and only when every rank loads its own file; otherwise the disk.

The files are the staging buffers. A rank keeps ``KEEP`` files, each made once for the state's tensors (their
dtypes and shapes), its pages reserved (``posix_fallocate``) and mapped into the process for as long as the rank
keeps it: a prefix (magic, step, where the header is), each tensor's bytes at a 64-byte aligned offset, then the
header (a pickle of plain containers and scalars, each tensor as its index in a table of dtype, shape and offset;
a class named in it is refused on load). A snapshot takes the rank's oldest file: it clears the magic, renames the
file to its ``.tmp`` name (which no reader opens), copies every CPU tensor into the file's mapping with one foreach
copy, and the background thread writes the header behind the tensors, the prefix, and renames the file to its
step's name (a rename keeps the mapping: the same inode). Nothing is serialized and no tensor byte goes through
``write``. The newest complete file is never touched while another is filled, so a crash or a failed copy midway
leaves it whole (the half-filled ``.tmp`` file is removed by the rank's next worker). A state whose tensors
changed (a new key, shape or dtype) gets a new file in place of the oldest one.

Tensors on a GPU keep the path proven before the files were mapped (not measured on a GPU since): a non-blocking
copy into pinned host buffers and an event after it on the training thread; the background thread waits for the
event and copies the buffers into the file. A state may mix both.

The hot path: ``save`` never waits for a write. When the previous snapshot of this rank is still being finished
the step is skipped (counted in ``skipped``); the agent then counts the newest step every rank has. The step pays
for ``state_dict()`` of each entry, the walk, a rename and the copy. Memory: a rank holds its ``KEEP`` files
(and, for GPU tensors, one pinned copy); before the files were mapped it held one host copy of every tensor
besides the files.

Shared memory full: a mapped tmpfs page that cannot be allocated is a SIGBUS at the first touch, in the step. The
pages of a file are reserved when it is made, so a full tmpfs is an OSError there instead, and it turns snapshots
off for this rank with one warning, as does any failure to copy or finish a file; nothing raises into the step.
Nothing truncates a mapped file: the agent only unlinks them, and an unlinked file's mapping stays valid.

Loading (``load``): the same rank at the same world size reads its own file and copies each tensor into the
matching tensor of the live state (``state_dict()`` gives the template: the model's parameters, an optimizer's
freshly initialised state), then hands the filled template to ``load_state_dict``, exactly what DCP does with
what it reads. A file that is torn, another rank's or step's, or that a writer took for a newer snapshot while it
was read (the prefix is read again after the file) is refused with the reason, as is any mismatch (another key,
shape or dtype), and the caller falls back to the disk. The writer thread records each tensor's XXH3-64 in the
header, and a load verifies them before it copies anything (runtime/checkpoint/memory_sums.py; ``mismatches``).

Another world size, or a rank whose file is on another node: when a file is made, the snapshot also records DCP's
view of the state (``_dcp_view``: each tensor's flattened key, global size and chunk offsets; each other value's
path), once per layout, off the per-step path. ``MappedSnapshot`` maps a complete file for
runtime/checkpoint/memory_reshard.py, which hands a step's files to ``dcp.load``.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from collections.abc import Mapping  # not typing's: isinstance() against it is several times slower
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.tensor import DTensor

from trainwarden.agent.shared.contract import MEMORY_DIR_ENV
from trainwarden.agent.shared.snapshot_layout import (KEEP, partial_path, peer_path, rank_partials, rank_snapshots,
                                                    snapshot_path)
from trainwarden.runtime.checkpoint import memory_sums
from trainwarden.runtime.checkpoint.snapshot_file import (_MAGIC, _NOT_LEAF, _PREFIX, _TENSOR, _UNSET, Layout,  # noqa: F401
                                                          _holds_containers,
                                                          MappedSnapshot, _aligned, _load, _mark_index, _SnapshotFile,
                                                          _walk, follow, holds_tensor_mark)
from trainwarden.runtime.checkpoint.state import put_back

__all__ = ["KEEP", "MappedSnapshot", "MemorySnapshots", "memory_dir_from_env"]

log = logging.getLogger(__name__)


def memory_dir_from_env(env: Mapping[str, str] | None = None) -> Path | None:
    """The agent's memory directory for this worker, or None (no agent, or it keeps no snapshots)."""
    raw = (os.environ if env is None else env).get(MEMORY_DIR_ENV, "").strip()
    return Path(raw) if raw else None


def _copy(buffers: list[torch.Tensor], sources: list[torch.Tensor], *, non_blocking: bool) -> None:
    """Copy each source into its buffer in one foreach call (per-tensor dispatch, not bytes, is most of the cost for
    a state of many small tensors); one by one where that is refused (mixed devices, an older torch)."""
    if not buffers:
        return
    with torch.no_grad():
        try:
            torch._foreach_copy_(buffers, sources, non_blocking=non_blocking)
        except (AttributeError, RuntimeError, TypeError):
            for buffer, source in zip(buffers, sources):
                buffer.copy_(source, non_blocking=non_blocking)


def _strip(value: Any, tensors: list[torch.Tensor], originals: dict[int, int] | None = None) -> Any:
    """``value``'s structure with each tensor (of a DTensor its local shard) appended to ``tensors`` and replaced by
    ``(_TENSOR, its index)``: the header's body. ``originals``, when given, maps each tensor object's ``id`` (the
    DTensor, not its shard) to its index."""

    def leaf(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return _NOT_LEAF
        if originals is not None:
            originals[id(value)] = len(tensors)
        if isinstance(value, DTensor):
            # the local shard itself (to_local() runs an autograd function per tensor: most of the walk's time)
            local = getattr(value, "_local_tensor", None)
            value = local if isinstance(local, torch.Tensor) else value.to_local()
        tensors.append(value)  # not detached (a tensor object per call): the copies run under no_grad
        return (_TENSOR, len(tensors) - 1)

    return _walk(value, leaf)


class _HostBuffers:
    """Pinned host buffers for the tensors that are not on the CPU (a GPU's), by their index in the snapshot's tensor
    table: the training thread starts non-blocking copies into them and records ``event``; the writer waits for it
    and copies the buffers into the mapped file. The training thread never synchronizes with the GPU."""

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}
        self.event = None

    def copy(self, indexed: list[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
        """Start copying each ``(index, tensor)``; the ``(index, buffer)`` pairs to move into the file after
        ``event``."""
        if not indexed:
            return []
        pairs = []
        for index, value in indexed:
            buffer = self._buffers.get(index)
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                buffer = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=value.is_cuda)
                self._buffers[index] = buffer
            pairs.append((index, buffer))
        _copy([buffer for _, buffer in pairs], [value for _, value in indexed], non_blocking=True)
        if any(value.is_cuda for _, value in indexed):
            if self.event is None:
                self.event = torch.cuda.Event()
            self.event.record()
        return pairs

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

def _dcp_view(states: dict[str, Any], originals: dict[int, int]) -> dict | None:
    """How DCP names and places this rank's part of ``states`` (each entry's state dict), for a restore at another
    world size or on another node (runtime/checkpoint/memory_reshard.py): each tensor's flattened key, its index in the tensor
    table, the global size and where this rank's chunk sits in it; each other value's key and path in the body.
    None when a tensor is not one the walk saw (the snapshot then serves the same rank only)."""
    flat, paths = flatten_state_dict(states)
    tensors, values = [], []
    for fqn, value in flat.items():
        if not isinstance(value, torch.Tensor):
            values.append((fqn, tuple(paths[fqn])))
            continue
        index = originals.get(id(value))
        items = _create_write_items(fqn, value)
        if index is None or len(items) != 1 or items[0].tensor_data is None:
            return None
        data = items[0].tensor_data
        tensors.append((fqn, tuple(paths[fqn]), index, tuple(data.size), tuple(data.chunk.offsets),
                        tuple(data.chunk.sizes)))
    return {"tensors": tensors, "values": values}


def _fill(template: Any, saved: Any, key: str) -> Any:
    """``template`` with every tensor's data replaced by ``saved``'s (in place) and every other value by the saved
    one; raises ValueError at the first difference in structure, shape or dtype."""
    if isinstance(template, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            raise ValueError(f"{key}: the snapshot holds {type(saved).__name__}, the state a tensor")
        local = template.to_local() if isinstance(template, DTensor) else template
        if local.shape != saved.shape or local.dtype != saved.dtype:
            raise ValueError(f"{key}: the snapshot holds {tuple(saved.shape)} {saved.dtype}, the state "
                             f"{tuple(local.shape)} {local.dtype}")
        with torch.no_grad():
            local.copy_(saved)
        return template
    if isinstance(template, Mapping):
        if not isinstance(saved, Mapping) or set(saved) != set(template):
            extra = sorted(map(str, set(saved) - set(template))) if isinstance(saved, Mapping) else []
            missing = sorted(map(str, set(template) - set(saved))) if isinstance(saved, Mapping) else []
            raise ValueError(f"{key}: keys differ (only in the snapshot: {extra[:5]}, only in the state: {missing[:5]})")
        return {k: _fill(v, saved[k], f"{key}/{k}") for k, v in template.items()}
    if isinstance(template, (list, tuple)) and not isinstance(saved, torch.Tensor):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(template):
            raise ValueError(f"{key}: a sequence of another length in the snapshot")
        if not _holds_containers(template):
            return saved
        filled = [_fill(t, s, f"{key}/{i}") for i, (t, s) in enumerate(zip(template, saved))]
        return filled if isinstance(template, list) else tuple(filled)
    return saved


class MemorySnapshots:
    """One rank's snapshots in the agent's memory directory (see the module's docstring)."""

    def __init__(self, directory: str | os.PathLike, *, rank: int, world_size: int,
                 report: Callable[[int, str, float], None] | None = None, keep: int = KEEP,
                 sums: bool = True) -> None:
        self.directory = Path(directory)
        self.sums = sums
        """Record each tensor's XXH3-64 in the file's header (runtime/checkpoint/memory_sums.py); off only to measure them."""
        self.mismatches: list[memory_sums.Mismatch] = []
        """What the last ``load`` found corrupt (its bytes differ from their sums); [] otherwise."""
        self.rank, self.world_size, self.keep = rank, world_size, max(1, keep)
        self._report = report  # (step, path, seconds) once a file is written
        self.on_written: Callable[[int, "_SnapshotFile"], None] | None = None
        """Called on the writer thread with each finished file (runtime/checkpoint/memory_peer.py sends it to a peer node)."""
        self._files: list[_SnapshotFile] = []  # this rank's files, oldest first: a snapshot takes the first
        self._host = _HostBuffers()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainwarden-snapshot")
        self._inflight: Future | None = None
        self._lock = threading.Lock()
        self._partials_swept = False  # the .tmp files a dead writer of this rank left are gone
        self._others_gone = False  # the complete files of an earlier worker of this rank are gone
        self._closed = False
        self.enabled = True
        self.saved = 0
        self.skipped = 0
        self.last_stage_seconds = 0.0
        self.last_write_seconds = 0.0
        self.last_step: int | None = None

    def save(self, step: int, state: Mapping[str, Any]) -> bool:
        """Snapshot ``state`` after ``step``: copy it into this rank's oldest file and finish the file in the
        background. False when skipped (the previous snapshot is not finished, or snapshots are off). Never
        raises."""
        if not self.enabled or self._closed:
            return False
        if self._inflight is not None and not self._inflight.done():
            self.skipped += 1
            return False
        if len(self._files) >= self.keep and self._files[0].pinned:  # still being sent to the peer node
            self.skipped += 1
            return False
        began = time.monotonic()
        file, doing = None, "copying the state"
        try:
            tensors: list[torch.Tensor] = []
            states = {name: entry.state_dict() if hasattr(entry, "state_dict") else entry
                      for name, entry in state.items()}
            body = {name: _strip(value, tensors) for name, value in states.items()}
            doing = "taking a file"
            file = self._take(step, [(t.dtype, t.shape) for t in tensors])
            if file.dcp is _UNSET:  # a new file: once per layout, not per step
                file.dcp = self._dcp_view(states)
            doing = "copying the state"
            on_cpu = [i for i, t in enumerate(tensors) if t.is_cpu]
            _copy([file.views[i] for i in on_cpu], [tensors[i] for i in on_cpu], non_blocking=False)
            staged = self._host.copy([(i, t) for i, t in enumerate(tensors) if not t.is_cpu])
        except Exception as exc:
            if file is not None:
                self._drop(file)  # it held this rank's oldest snapshot; the newest is untouched
            self._turn_off(f"{doing} for step {step} failed ({type(exc).__name__}: {exc})")
            return False
        self.last_stage_seconds = time.monotonic() - began
        self._inflight = self._writer.submit(self._write, step, file, body, staged)
        return True

    def _take(self, step: int, layout: Layout) -> _SnapshotFile:
        """The file this snapshot goes into, under its partial name: the oldest of this rank's files, or a new one
        while it has fewer than ``keep`` or the state's tensors changed (the oldest file is removed first)."""
        path = partial_path(self.directory, self.world_size, self.rank, step)
        if len(self._files) >= self.keep and self._files[0].layout == layout:
            file = self._files.pop(0)
            try:
                file.reuse(path)
            except BaseException:
                file.remove()
                raise
        else:
            if len(self._files) >= self.keep:
                self._files.pop(0).remove()  # its memory back before the new file reserves its own
            path.parent.mkdir(parents=True, exist_ok=True)
            if not self._partials_swept:
                for leftover in rank_partials(self.directory, self.world_size, self.rank):
                    leftover.unlink(missing_ok=True)  # a writer of this rank that died while writing
                self._partials_swept = True
            file = _SnapshotFile(path, layout)
        self._files.append(file)
        return file

    def _dcp_view(self, states: dict[str, Any]) -> dict | None:
        originals: dict[int, int] = {}
        seen: list[torch.Tensor] = []
        for value in states.values():
            _strip(value, seen, originals)  # the same walk, the same order: each tensor object's index
        try:
            return _dcp_view(states, originals)
        except Exception as exc:  # the snapshot still serves this rank at this world size
            log.debug("no DCP view of rank %d's snapshot (%s: %s)", self.rank, type(exc).__name__, exc)
            return None

    def _drop(self, file: _SnapshotFile) -> None:
        if file in self._files:
            self._files.remove(file)
        file.remove()

    def _write(self, step: int, file: _SnapshotFile, body: dict, staged: list[tuple[int, torch.Tensor]]) -> None:
        """Finish the file (off the training thread): the GPU's tensors into it, the header, the rename; then
        drop an earlier worker's files beyond ``keep`` and report."""
        began = time.monotonic()
        path = snapshot_path(self.directory, self.world_size, self.rank, step)
        try:
            if staged:
                self._host.wait()  # the copies from the GPU
                _copy([file.views[i] for i, _ in staged], [buffer for _, buffer in staged], non_blocking=False)
            sums = file.sums() if self.sums else None  # the bytes in the mapping, off the training thread
            header = pickle.dumps({"body": {"step": step, "rank": self.rank, "world_size": self.world_size,
                                            "state": body}, "tensors": file.table, "dcp": file.dcp, "sums": sums},
                                  protocol=pickle.HIGHEST_PROTOCOL)
            file.publish(step, header, path)
        except Exception as exc:
            self._drop(file)
            self._turn_off(f"writing {path} failed ({type(exc).__name__}: {exc})")
            return
        self.last_write_seconds = time.monotonic() - began
        self.saved += 1
        self.last_step = step
        if not self._others_gone:  # this rank keeps `keep` files in all, its own first
            mine = {file.path for file in self._files}
            others = [old for _, old in rank_snapshots(self.directory, self.world_size, self.rank) if old not in mine]
            for old in others[max(0, self.keep - len(self._files)):]:
                try:
                    old.unlink()
                except OSError:
                    pass
            self._others_gone = len(self._files) >= self.keep
        if self._report is not None:
            try:
                self._report(step, str(path), self.last_write_seconds)
            except Exception:
                log.debug("could not report the snapshot of step %d", step, exc_info=True)
        if self.on_written is not None:
            try:
                self.on_written(step, file)
            except Exception:
                log.debug("could not hand the snapshot of step %d on", step, exc_info=True)

    def _turn_off(self, why: str) -> None:
        with self._lock:
            if not self.enabled:
                return
            self.enabled = False
        log.warning("memory snapshots are off for rank %d: %s. Restarts restore from the disk checkpoints; free "
                    "shared memory (df /dev/shm) or run with --no-memory-snapshots", self.rank, why,
                    extra={"event": "snapshot_off"})

    def wait(self) -> None:
        """Block until the snapshot being written (if any) is written."""
        inflight = self._inflight
        if inflight is not None:
            inflight.result()

    def load(self, step: int, state: Mapping[str, Any]) -> str:
        """Load this rank's snapshot of ``step`` into ``state``; "" when loaded, else what failed (nothing of
        ``state`` is changed when the file cannot be read or does not match; a failure while loading may leave
        part of it loaded, and the caller then loads a disk checkpoint over it)."""
        path = snapshot_path(self.directory, self.world_size, self.rank, step)
        if not path.is_file() and peer_path(self.directory, self.world_size, self.rank, step).is_file():
            path = peer_path(self.directory, self.world_size, self.rank, step)  # the copy a peer node sent here
        self.mismatches = []
        try:
            saved = _load(path)
        except FileNotFoundError:
            return f"rank {self.rank} has no snapshot of step {step} in {path.parent}"
        except memory_sums.SnapshotCorrupt as exc:
            self.mismatches = exc.mismatches
            return f"{path} does not match its sums: {exc}"
        except Exception as exc:
            return f"{path} cannot be read ({type(exc).__name__}: {exc})"
        if (saved.get("step"), saved.get("rank"), saved.get("world_size")) != (step, self.rank, self.world_size):
            return (f"{path} holds step {saved.get('step')} of rank {saved.get('rank')} at world size "
                    f"{saved.get('world_size')}")
        snapshot = saved.get("state", {})
        if set(snapshot) != set(state):
            return f"{path} holds entries {sorted(snapshot)}, the state {sorted(state)}"
        try:
            filled, plain = {}, {}
            for name, entry in state.items():
                if hasattr(entry, "state_dict"):
                    filled[name] = _fill(entry.state_dict(), snapshot[name], name)
                else:  # a plain dict, list or number: back in place, as from disk (put_back)
                    plain[name] = _fill(entry, snapshot[name], name)
            for name, value in filled.items():
                state[name].load_state_dict(value)
            for name, value in plain.items():
                put_back(state, name, value)
        except Exception as exc:
            return f"{path} does not match the state ({type(exc).__name__}: {exc})"
        self.last_step = step
        return ""

    def close(self) -> None:
        """Finish the snapshot in flight, stop the writer thread and unmap the files (they stay: the agent owns
        them)."""
        self._closed = True
        self._writer.shutdown(wait=True)
        for file in self._files:
            file.release()
        self._files = []

"""A memory snapshot's file: its format, reading it whole (``_load``) or mapped (``MappedSnapshot``), and the walk
over a state's containers that both writing and reading use.

The format (written by ``MemorySnapshots`` in runtime/checkpoint/memory_snapshot.py, which explains why it is so): a
prefix (``_MAGIC``, the step, where the header is and its length), each tensor's bytes at a 64-byte aligned offset,
then the header, a pickle of plain containers and scalars in which each tensor is a ``(_TENSOR, index)`` mark into
its table of dtype, shape, offset and length, and each tensor's XXH3-64 (runtime/checkpoint/memory_sums.py). A
class named in a header is refused (``_NoClasses``). ``_SnapshotFile`` is the writer's side of one file: created
once per layout, its pages reserved and mapped, reused by later snapshots.
"""

from __future__ import annotations

import io
import math
import mmap
import os
import pickle
import struct
from collections.abc import Mapping  # not typing's: isinstance() against it is several times slower
from pathlib import Path
from typing import Any, Callable

import torch

from trainwarden.runtime.checkpoint import memory_sums

__all__ = ["Layout", "MappedSnapshot", "follow", "holds_tensor_mark"]

_CONTAINERS = (torch.Tensor, Mapping, list, tuple)
_SCALARS = frozenset((int, float, bool, str, bytes, type(None)))
_NOT_LEAF = object()
_TENSOR = "__trainwarden_tensor__"  # (_TENSOR, index): a tensor in the header's body


def _mark_index(value: Any) -> int | None:
    """The tensor index of a ``(_TENSOR, index)`` mark in a header's body; None for anything else."""
    return value[1] if isinstance(value, tuple) and len(value) == 2 and value[0] == _TENSOR else None


def _holds_containers(values: list | tuple) -> bool:
    # the type lookup first: an isinstance() against an ABC costs ~10 times more, 625 times for an RNG state
    return any(type(v) not in _SCALARS and isinstance(v, _CONTAINERS) for v in values)


def _walk(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value``'s structure (mappings as dicts, lists, tuples) with each leaf replaced by what ``leaf`` returns for it;
    returns ``_NOT_LEAF`` for what is not one. A sequence holding no container nor tensor (Python's RNG state: 625
    ints) is one value, copied as a whole rather than walked."""
    out = leaf(value)
    if out is not _NOT_LEAF:
        return out
    if isinstance(value, Mapping):
        return {k: _walk(v, leaf) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if not _holds_containers(value):
            return list(value) if isinstance(value, list) else value
        items = [_walk(v, leaf) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


_UNSET = object()
_MAGIC = b"TWSNAP2\n"
_PREFIX = struct.Struct("<8sQQQ")
"""A file's first bytes: the magic, the step, the header's offset and its length. A snapshot writes them last and a
reuse clears the magic first."""
_ALIGN = 64

Layout = list[tuple[torch.dtype, torch.Size]]
"""The dtype and shape of each tensor of a snapshot, in the order of its tensor table: what a file is made for."""


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


class _NoClasses(pickle.Unpickler):
    """The header holds plain containers and scalars only: any class in it is refused."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"a snapshot header may not name {module}.{name}")


class _SnapshotFile:
    """One of a rank's snapshot files, created once per layout and mapped for as long as the rank keeps it: the
    prefix, each tensor's bytes at a 64-byte aligned offset (``views``: where a snapshot's tensors are copied), then
    the header (a pickle of the body, with each tensor as ``(_TENSOR, index)``, and the tensor table), rewritten by
    every snapshot. The mapped part's pages are reserved when the file is created, so a full tmpfs is an OSError
    there and never a SIGBUS at a copy into the mapping."""

    def __init__(self, path: Path, layout: Layout) -> None:
        self.path, self.layout = path, layout
        self.dcp: Any = _UNSET
        """DCP's view of the state this file was made for (``_dcp_view``); set by the snapshot that made it."""
        self.pinned = False
        """Being sent to a peer node (runtime/checkpoint/memory_peer.py): no snapshot takes it meanwhile (it skips)."""
        self.table: list[tuple[str, tuple[int, ...], int, int]] = []
        offset = _aligned(_PREFIX.size)
        for dtype, shape in layout:
            nbytes = math.prod(shape) * dtype.itemsize
            self.table.append((str(dtype).removeprefix("torch."), tuple(shape), offset, nbytes))
            offset = _aligned(offset + nbytes)
        self.data_end = offset
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.data_end)
            self._map = mmap.mmap(fd, self.data_end, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self._fd = fd
        base = torch.frombuffer(self._map, dtype=torch.uint8)
        self.views = [base[at:at + nbytes].view(dtype).view(shape)
                      for (dtype, shape), (_, _, at, nbytes) in zip(layout, self.table)]

    def reuse(self, path: Path) -> None:
        """Take the file for a new snapshot, renamed to ``path`` (its name while being written, which no reader
        opens). The magic is cleared first: a reader that opened the file under its old name refuses what it read."""
        self._map[:len(_MAGIC)] = bytes(len(_MAGIC))
        os.replace(self.path, path)
        self.path = path

    def publish(self, step: int, header: bytes, path: Path) -> None:
        """Write ``header`` behind the tensors, then the prefix, and rename the file to ``path``: a reader finds the
        file only once it is complete."""
        os.pwrite(self._fd, header, self.data_end)
        os.ftruncate(self._fd, self.data_end + len(header))  # a longer header of an earlier step: its tail
        self._map[:_PREFIX.size] = _PREFIX.pack(_MAGIC, step, self.data_end, len(header))
        os.replace(self.path, path)
        self.path = path

    def sums(self) -> dict:
        """Each tensor's XXH3-64 from the mapping (memory_sums.record)."""
        return memory_sums.record(self._map, self.table)

    def release(self) -> None:
        """Let go of the mapping (unmapped once no copy holds one of its views); the file stays."""
        self.views = []
        self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def remove(self) -> None:
        """Release the mapping and unlink the file: its memory goes back to the tmpfs."""
        self.release()
        try:
            self.path.unlink()
        except OSError:
            pass


def _load(path: Path) -> Any:
    """What a snapshot file holds, with tensors that own their memory; ValueError when the file is not one, is
    torn, or was taken for a newer snapshot while it was read."""
    with open(path, "rb") as f:
        data = f.read()
        again = os.pread(f.fileno(), _PREFIX.size, 0)  # a writer clears the magic before it touches a tensor
    if len(data) < _PREFIX.size or not data.startswith(_MAGIC):
        if data[:len(_MAGIC)] == bytes(len(_MAGIC)) and len(data) >= _PREFIX.size:
            raise ValueError("being rewritten (its magic is cleared: a newer snapshot took the file)")
        raise ValueError("not a trainwarden snapshot (no magic)")
    if again != data[:_PREFIX.size]:
        raise ValueError("rewritten while it was read (a newer snapshot took the file)")
    _, step, at, length = _PREFIX.unpack_from(data)
    if at + length > len(data):
        raise ValueError(f"torn: the header ends at {at + length}, the file at {len(data)}")
    header = _NoClasses(io.BytesIO(data[at:at + length])).load()
    if not isinstance(header, dict) or not isinstance(header.get("body"), dict) or header["body"].get("step") != step:
        raise ValueError(f"torn: the header is not the one of step {step}")
    if any(offset + nbytes > at for _, _, offset, nbytes in header["tensors"]):
        raise ValueError(f"torn: a tensor's bytes end after the header's beginning at {at}")
    if mismatches := memory_sums.verify(header, data, path):
        raise memory_sums.SnapshotCorrupt(mismatches)
    tensors = []
    for dtype, shape, offset, nbytes in header["tensors"]:
        if offset + nbytes > at:
            raise ValueError(f"torn: a tensor's bytes end at {offset + nbytes}, the header begins at {at}")
        kind = getattr(torch, dtype, None)
        if not isinstance(kind, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        tensors.append(torch.frombuffer(bytearray(data[offset:offset + nbytes]), dtype=kind).reshape(shape)
                       if nbytes else torch.empty(shape, dtype=kind))

    def fill(value: Any) -> Any:
        index = _mark_index(value)
        return _NOT_LEAF if index is None else tensors[index]

    return _walk(header["body"], fill)


def follow(header: dict, path: tuple) -> Any:
    """The value at ``path`` (DCP's object path: mapping keys as strings, sequence indices) in a snapshot header's
    state, tensors still as their ``(_TENSOR, index)`` marks; KeyError when the body has nothing there."""
    value: Any = header["body"]["state"]
    for key in path:
        if isinstance(value, Mapping):
            match = [k for k in value if str(k) == str(key)]
            if len(match) != 1:
                raise KeyError(f"{'.'.join(map(str, path))}: no {key!r} in the snapshot")
            value = value[match[0]]
        elif isinstance(value, (list, tuple)) and isinstance(key, int) and 0 <= key < len(value):
            value = value[key]
        else:
            raise KeyError(f"{'.'.join(map(str, path))}: no {key!r} in the snapshot")
    return value


def holds_tensor_mark(value: Any) -> bool:
    """Whether a value of a header's state has a tensor in it (a ``(_TENSOR, index)`` mark)."""
    if _mark_index(value) is not None:
        return True
    if isinstance(value, Mapping):
        return any(holds_tensor_mark(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_tensor_mark(v) for v in value)
    return False


class MappedSnapshot:
    """A complete snapshot file mapped read-only in effect (private, copy-on-write pages: nothing is written back), for
    a restore at another world size or on another node (runtime/checkpoint/memory_reshard.py): its header and a view of each
    tensor, no byte copied until a caller copies it. ValueError when the file is not one or is torn; ``check`` says
    whether a writer took it since (its prefix changed)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _PREFIX.size:
                raise ValueError(f"torn: {size} bytes")
            self._map = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        self._prefix = bytes(self._map[:_PREFIX.size])
        magic, self.step, at, length = _PREFIX.unpack(self._prefix)
        if magic != _MAGIC:
            raise ValueError("being rewritten (its magic is cleared)" if magic == bytes(len(_MAGIC))
                             else "not a trainwarden snapshot (no magic)")
        if at + length > size:
            raise ValueError(f"torn: the header ends at {at + length}, the file at {size}")
        header = _NoClasses(io.BytesIO(self._map[at:at + length])).load()
        if not isinstance(header, dict) or not isinstance(header.get("body"), dict) \
                or header["body"].get("step") != self.step:
            raise ValueError(f"torn: the header is not the one of step {self.step}")
        self.header = header
        self._base = torch.frombuffer(self._map, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        self._at = at

    def tensor(self, index: int) -> torch.Tensor:
        """A view of the tensor at ``index`` of the table (valid while this object lives)."""
        dtype, shape, offset, nbytes = self.header["tensors"][index]
        kind = getattr(torch, dtype, None)
        if not isinstance(kind, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        if offset + nbytes > self._at:
            raise ValueError(f"torn: a tensor's bytes end at {offset + nbytes}, the header begins at {self._at}")
        if not nbytes:
            return torch.empty(shape, dtype=kind)
        return self._base[offset:offset + nbytes].view(kind).view(shape)

    def value(self, path: tuple) -> Any:
        """The body's value at ``path`` (DCP's object path: mapping keys as strings, sequence indices), with each
        tensor in it read from the file (a copy)."""

        def fill(item: Any) -> Any:
            index = _mark_index(item)
            return _NOT_LEAF if index is None else self.tensor(index).clone()

        return _walk(follow(self.header, path), fill)

    def holds_tensor(self, path: tuple, index: int) -> bool:
        """Whether the body has the tensor ``index`` at ``path`` (DCP's view was made for the same structure)."""
        try:
            value = follow(self.header, path)
        except KeyError:
            return False
        return _mark_index(value) == index

    def verify(self, indices: list[int] | None = None) -> list[memory_sums.Mismatch]:
        """The tensors (every one, or those at ``indices``) whose bytes differ from the sums recorded when the file
        was written (memory_sums.py)."""
        if any(offset + nbytes > self._at for _, _, offset, nbytes in self.header["tensors"]):
            raise ValueError(f"torn: a tensor's bytes end after the header's beginning at {self._at}")
        return memory_sums.verify(self.header, self._map, self.path, indices)

    def check(self) -> None:
        """ValueError when a writer took the file since it was opened (its prefix changed)."""
        with open(self.path, "rb") as f:
            if os.pread(f.fileno(), _PREFIX.size, 0) != self._prefix:
                raise ValueError(f"{self.path} was rewritten while it was read")

    def close(self) -> None:
        self._base = None
        self._map = None  # unmapped once no view of it is left

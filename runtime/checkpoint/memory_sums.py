"""Checksums of memory snapshots (issue 48, item 1): a flipped byte in host memory is found before it is trained on.

A memory snapshot (runtime/checkpoint/memory_snapshot.py) is a file in the node agent's shared memory holding each tensor's bytes
at an offset of its own. When the writer thread finishes a file (off the training thread, after the step's copy into
the file's mapping) it hashes each tensor's bytes from that mapping, the bytes in hand (never a second read of the
GPU), with XXH3-64, the disk checkpoints' algorithm (agent/shared/checkpoint_sums.py), and records the sums in the
file's header (``{"algorithm": "xxh3_64", "tensors": [hex, ...]}``, one per entry of the tensor table). The copy a peer
node keeps (runtime/checkpoint/memory_peer.py) is the same bytes, header included, so it carries the same sums.

A restore from memory verifies every tensor it is about to use against its sum (``verify``): the own file before
``MemorySnapshots.load`` copies anything out of it, and each file a rank serves in a resharded restore
(runtime/checkpoint/memory_reshard.py). A mismatch is a ``Mismatch`` naming the file, the snapshot's rank, which copy it is
(``own`` or ``peer``), the buffer (its key in the state) and both sums. The ranks gather the verdicts and decide
together (runtime/checkpoint/memory.py): the file is set aside (``set_aside``: renamed ``<name>.corrupt``, which no
reader opens and the agent removes with its directory), one ``set_aside`` incident names it, and the restore chooses
again: another copy of the step (the peer's), an older step still in memory, else the disk's checkpoints. A file
written before sums were recorded is used unverified.

XXH3 finds storage and memory errors, not an attacker who can write the agent's directory.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import xxhash

from trainwarden.agent.shared.checkpoint_sums import ALGORITHM
from trainwarden.agent.shared.snapshot_layout import parse_peer

__all__ = ["ALGORITHM", "CORRUPT_SUFFIX", "Mismatch", "SnapshotCorrupt", "record", "set_aside", "verify"]

log = logging.getLogger(__name__)

CORRUPT_SUFFIX = ".corrupt"

Table = list[tuple[str, tuple[int, ...], int, int]]
"""A snapshot's tensor table: (dtype, shape, offset, nbytes) of each tensor, in index order."""


def _sum(view: memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(view)


def record(data: Any, table: Table) -> dict:
    """The sums of each tensor of ``table`` in ``data`` (a file's mapping, or its bytes), for the file's header."""
    with memoryview(data) as whole:
        return {"algorithm": ALGORITHM,
                "tensors": [_sum(whole[offset:offset + nbytes]) for _, _, offset, nbytes in table]}


@dataclass(frozen=True)
class Mismatch:
    """A tensor of a memory snapshot whose bytes differ from the sum recorded when it was written."""

    file: str
    """The file as it was found (``aside``: where it was moved)."""
    rank: int
    """The rank whose snapshot it is."""
    step: int
    copy: str
    """``own`` (the rank's own file, on its node) or ``peer`` (the copy on the next node)."""
    buffer: str
    """The tensor's key in the state (``train/model/0.weight``) and its index in the file's table."""
    expected: str
    found: str
    aside: str = ""

    def __str__(self) -> str:
        return (f"{self.file} (rank {self.rank}'s {self.copy} copy of step {self.step}): buffer {self.buffer}: "
                f"{ALGORITHM} {self.found}, recorded {self.expected}")


class SnapshotCorrupt(ValueError):
    """A snapshot file's bytes differ from its sums; not retryable: the file is set aside and another source used."""

    def __init__(self, mismatches: list[Mismatch]) -> None:
        super().__init__("; ".join(map(str, mismatches[:4])) + (f" (and {len(mismatches) - 4} more buffers)"
                                                                 if len(mismatches) > 4 else ""))
        self.mismatches = mismatches


def copy_of(path: str | os.PathLike) -> str:
    """Which copy a snapshot file is: ``peer`` (received from another node) or ``own``."""
    return "peer" if parse_peer(path) is not None else "own"


def verify(header: dict, data: Any, path: str | os.PathLike, indices: Iterable[int] | None = None) -> list[Mismatch]:
    """The tensors of the snapshot file ``path`` (its ``header`` and its bytes ``data``: the file read, or mapped;
    every tensor, or those at ``indices`` of its table) whose bytes differ from the sums in the header; [] when
    every one matches or the file records none."""
    sums = header.get("sums")
    if not isinstance(sums, Mapping) or sums.get("algorithm") != ALGORITHM:
        return []  # written before sums were recorded: unverified
    table, expected = header["tensors"], sums.get("tensors")
    if not isinstance(expected, list) or len(expected) != len(table):
        return [_mismatch(header, path, -1, f"{len(table)} sums", f"{len(expected or [])} recorded"
                          if isinstance(expected, list) else "no list of sums")]
    wrong = []
    with memoryview(data) as whole:
        for index in range(len(table)) if indices is None else indices:
            _, _, offset, nbytes = table[index]
            found = _sum(whole[offset:offset + nbytes])
            if found != expected[index]:
                wrong.append(_mismatch(header, path, index, expected[index], found))
    return wrong


def _mismatch(header: dict, path: str | os.PathLike, index: int, expected: str, found: str) -> Mismatch:
    body = header.get("body", {})
    name = _names(body.get("state", {})).get(index, "?") if index >= 0 else "the table"
    return Mismatch(file=str(path), rank=int(body.get("rank", -1)), step=int(body.get("step", -1)),
                    copy=copy_of(path), buffer=f"{name} (tensor {index})" if index >= 0 else name,
                    expected=str(expected), found=str(found))


def _names(state: Any, prefix: str = "") -> dict[int, str]:
    """Each tensor index of a header's state -> its key path (``train/model/0.weight``); found only for a report."""
    from trainwarden.runtime.checkpoint.snapshot_file import _mark_index  # not at the top: that module imports this one

    index = _mark_index(state)
    if index is not None:
        return {index: prefix or "."}
    out: dict[int, str] = {}
    if isinstance(state, Mapping):
        for key, value in state.items():
            out.update(_names(value, f"{prefix}/{key}" if prefix else str(key)))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            out.update(_names(value, f"{prefix}/{i}" if prefix else str(i)))
    return out


def set_aside(mismatches: list[Mismatch]) -> list[Mismatch]:
    """Move each file named in ``mismatches`` out of the way of every reader (``<name>.corrupt``, kept for
    inspection until the agent removes its directory); the mismatches with ``aside`` set. A file that cannot be
    moved is removed; one that cannot be either stays, and the restore's next choice meets it again."""
    moved: dict[str, str] = {}
    for path in {m.file for m in mismatches}:
        target = Path(path).with_name(Path(path).name + CORRUPT_SUFFIX)
        try:
            os.replace(path, target)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and target.exists():  # another rank of the node moved it
                moved[path] = str(target)
                continue
            try:
                os.unlink(path)
                moved[path] = f"nowhere: removed (could not move it: {exc})"
            except OSError:
                moved[path] = f"nowhere: left in place (could not move or remove it: {exc})"
            continue
        moved[path] = str(target)
    return [Mismatch(**{**m.__dict__, "aside": moved[m.file]}) for m in mismatches]

"""Where the workers' in-memory snapshots live: one file per rank and step under the agent's memory directory.

The node agent (``trainwarden run``) owns a directory in shared memory (``/dev/shm``) for the lifetime of the
run and names it to the workers in ``MEMORY_DIR_ENV``; worker processes come and go, the directory stays.
Each rank writes its own shards of the job's state there after every step it snapshots (runtime
``memory_snapshot``) and reports the file's path; the agent counts a step as snapshotted when every rank of
the world size has reported it (agent ``launch/memory_tier``). Both sides read the names with this module::

    <memory dir>/world-8/rank-00003.step-00000017.pt      rank 3 of 8, after step 17
    <memory dir>/world-8/rank-00003.step-00000017.pt.tmp  being written (never read); its writer may have died
    <memory dir>/world-8/peer/rank-00001.step-00000016.pt  a copy of rank 1's file, which lives on another node,
                                                           received by a rank of this node (runtime memory_peer)

A file holds only what its rank owns (the local shards of DTensors): the same rank at the same world size loads it
directly; a restore into another world size (or with the ranks numbered anew) reads all of one step's files of a
``world-N`` directory through DCP (runtime ``memory_reshard``). Snapshots of a new world size go to a new ``world-N``
directory; the agent removes the old one once a rank reports a file of the new one.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["KEEP", "PEER_DIR", "parse_peer", "parse_snapshot", "partial_path", "peer_path", "peer_snapshots",
           "rank_partials", "rank_snapshots", "snapshot_path", "world_dir"]

KEEP = 2
"""Files a rank keeps: its newest and the one before, so a step one rank skipped still leaves a step every rank has
(the agent counts only the steps a rank still keeps)."""

_NAME_RE = re.compile(r"^rank-(\d{5,})\.step-(\d{8,})\.pt$")
_PARTIAL_SUFFIX = ".tmp"
_WORLD_RE = re.compile(r"^world-(\d+)$")


def world_dir(root: str | os.PathLike, world_size: int) -> Path:
    """The directory of the snapshots taken at ``world_size``."""
    return Path(root) / f"world-{int(world_size)}"


def snapshot_path(root: str | os.PathLike, world_size: int, rank: int, step: int) -> Path:
    """The file of ``rank``'s snapshot after ``step``."""
    return world_dir(root, world_size) / f"rank-{int(rank):05d}.step-{int(step):08d}.pt"


def partial_path(root: str | os.PathLike, world_size: int, rank: int, step: int) -> Path:
    """The name of ``rank``'s snapshot of ``step`` while it is being written: no reader ever opens it."""
    path = snapshot_path(root, world_size, rank, step)
    return path.with_name(path.name + _PARTIAL_SUFFIX)


PEER_DIR = "peer"
"""The directory, inside a ``world-N`` one, of the copies of other nodes' ranks' files."""


def peer_path(root: str | os.PathLike, world_size: int, rank: int, step: int) -> Path:
    """Where a node keeps its copy of ``rank``'s snapshot after ``step``, when ``rank`` lives on another node."""
    return world_dir(root, world_size) / PEER_DIR / f"rank-{int(rank):05d}.step-{int(step):08d}.pt"


def parse_peer(path: str | os.PathLike) -> tuple[int, int, int] | None:
    """(world size, rank, step) named by a peer copy's path; None for anything else."""
    path = Path(path)
    if path.parent.name != PEER_DIR:
        return None
    name, world = _NAME_RE.match(path.name), _WORLD_RE.match(path.parent.parent.name)
    if name is None or world is None:
        return None
    return int(world.group(1)), int(name.group(1)), int(name.group(2))


def peer_snapshots(root: str | os.PathLike, world_size: int, rank: int) -> list[tuple[int, Path]]:
    """(step, path) of this node's complete copies of ``rank``'s files at ``world_size``, newest first."""
    try:
        entries = list((world_dir(root, world_size) / PEER_DIR).iterdir())
    except OSError:
        return []
    found = [(parsed[2], entry) for entry in entries if (parsed := parse_peer(entry)) is not None and parsed[1] == rank]
    return sorted(found, reverse=True)


def parse_snapshot(path: str | os.PathLike) -> tuple[int, int, int] | None:
    """(world size, rank, step) named by a snapshot file's path; None for anything else (a ``.tmp`` file)."""
    path = Path(path)
    name, world = _NAME_RE.match(path.name), _WORLD_RE.match(path.parent.name)
    if name is None or world is None:
        return None
    return int(world.group(1)), int(name.group(1)), int(name.group(2))


def rank_snapshots(root: str | os.PathLike, world_size: int, rank: int) -> list[tuple[int, Path]]:
    """(step, path) of ``rank``'s complete snapshot files at ``world_size``, newest first."""
    found = []
    try:
        entries = list(world_dir(root, world_size).iterdir())
    except OSError:
        return []
    for entry in entries:
        parsed = parse_snapshot(entry)
        if parsed is not None and parsed[1] == rank:
            found.append((parsed[2], entry))
    return sorted(found, reverse=True)


def rank_partials(root: str | os.PathLike, world_size: int, rank: int) -> list[Path]:
    """``rank``'s files being written at ``world_size``, or left half written by a writer that died."""
    try:
        entries = list(world_dir(root, world_size).iterdir())
    except OSError:
        return []
    return [entry for entry in entries if entry.name.endswith(_PARTIAL_SUFFIX)
            and (parsed := parse_snapshot(entry.with_name(entry.name[:-len(_PARTIAL_SUFFIX)]))) is not None
            and parsed[1] == rank]

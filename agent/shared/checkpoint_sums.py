"""Checksums of a checkpoint's files (issue 48, item 1): a flipped byte is found before it is trained on.

Each rank hashes the data files it writes while it writes them (runtime/checkpoint/sums.py, on DCP's writer
threads, never the training thread) and writes ``.sums-rank-R.json`` before DCP's gather of write results, so the
sidecars exist before ``.metadata`` does. At commit rank 0 merges them into the commit marker (``COMMITTED``:
``{"sums": {"algorithm": "xxh3_64", "files": {name: {"sum", "bytes", "rank"}}}}``). A restore verifies every file
of the checkpoint it is about to load (``verify``; the files are shared out among the ranks) and sets a mismatch
aside as ``corrupt``, naming the file, the rank that wrote it and both sums; `trainwarden checkpoints --verify`
runs the same check on demand. A checkpoint without recorded sums (written before this, or by plain DCP) is
``unverified``, never refused for that.

XXH3-64 (the ``xxhash`` package): about 10 GB/s a core, so a save's background time grows by the hashing of bytes
it already has in hand (BENCHMARKS.md); not a cryptographic hash: it finds storage and transfer errors, not an
attacker who can write the directory.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import xxhash

from trainwarden.agent.shared.regular_file import NotARegularFile, read_regular

__all__ = ["ALGORITHM", "Mismatch", "hasher", "file_sum", "merge_sidecars", "recorded_sums", "sidecar_name",
           "verify"]

ALGORITHM = "xxh3_64"
_CHUNK = 8 << 20
_SIDECAR_PREFIX = ".sums-rank-"
_MARKER_BYTES = 64 << 20
"""Most bytes of a commit marker read (about 100 bytes per recorded file)."""


def hasher():
    return xxhash.xxh3_64()


def sidecar_name(rank: int) -> str:
    return f"{_SIDECAR_PREFIX}{rank}.json"


def file_sum(path: Path) -> tuple[str, int]:
    """The file's sum and size, read in chunks (no symlink followed, never blocking on a FIFO: root reads these
    with ``trainwarden checkpoints --verify``); ``NotARegularFile`` when it is not a regular file."""
    h, size = hasher(), 0
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotARegularFile(f"{path} is not a regular file; only regular files of a checkpoint are read")
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def merge_sidecars(path: Path) -> dict | None:
    """Every rank's sidecar in checkpoint ``path`` merged into the commit record's ``sums``; None when a rank
    wrote none (an older writer): the checkpoint is then committed unverified."""
    files: dict[str, dict] = {}
    found = sorted(path.glob(f"{_SIDECAR_PREFIX}*.json"))
    if not found:
        return None
    try:
        for sidecar in found:
            raw = json.loads(sidecar.read_text())
            if raw.get("algorithm") != ALGORITHM:
                return None
            rank = int(raw["rank"])
            for name, entry in raw["files"].items():
                files[name] = {"sum": str(entry["sum"]), "bytes": int(entry["bytes"]), "rank": rank}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # a sidecar that cannot be read: committed unverified rather than not at all
    return {"algorithm": ALGORITHM, "files": files}


def recorded_sums(path: Path) -> dict[str, dict] | None:
    """The sums recorded in checkpoint ``path``'s commit marker: {file: {sum, bytes, rank}}; None when it has
    none (unverified), or the marker is missing or unreadable."""
    from trainwarden.agent.shared.checkpoint_layout import COMMIT_MARKER

    try:
        raw = json.loads(read_regular(path / COMMIT_MARKER, _MARKER_BYTES))
        sums = raw.get("sums")
        if not isinstance(sums, dict) or sums.get("algorithm") != ALGORITHM:
            return None
        return {str(k): dict(v) for k, v in sums["files"].items()}
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        return None


@dataclass(frozen=True)
class Mismatch:
    file: str
    rank: int  # the rank that wrote it
    expected: str
    found: str  # the sum found ("... over N bytes" when the size differs too), or "missing"
    bytes: int

    def __str__(self) -> str:
        return (f"{self.file} (written by rank {self.rank}): {ALGORITHM} {self.found}, recorded {self.expected} "
                f"({self.bytes} bytes)")


def verify(path: Path, files: Iterable[str] | None = None, *, sums: dict[str, dict] | None = None) -> list[Mismatch]:
    """The files of checkpoint ``path`` (all recorded ones, or ``files`` among them) whose bytes do not match
    their recorded sums; [] when they all do or nothing is recorded. A file that cannot be read (permissions, I/O)
    raises its OSError: that is the storage's failure, not proof of corruption."""
    sums = recorded_sums(path) if sums is None else sums
    if not sums:
        return []
    wrong = []
    for name in (sorted(sums) if files is None else files):
        entry = sums[name]
        if name in ("", ".", "..") or "/" in name or "\0" in name:  # the marker is the job user's to write
            wrong.append(Mismatch(file=name, rank=int(entry.get("rank", -1)), expected=str(entry.get("sum")),
                                  found="not a file name in the checkpoint directory: not read",
                                  bytes=int(entry.get("bytes", 0))))
            continue
        try:
            found, size = file_sum(path / name)
            if size != entry["bytes"]:
                found = f"{found} over {size} bytes"
        except FileNotFoundError:
            found = "missing"
        if found != entry["sum"]:
            wrong.append(Mismatch(file=name, rank=int(entry.get("rank", -1)), expected=entry["sum"], found=found,
                                  bytes=int(entry["bytes"])))
    return wrong

"""Writing a small file so that readers see the old content or the new, never a mix.

Used for the checkpoint pointer and manifest, RNG sidecars, incident records and the agent-socket record.
A uniquely named temporary file in the same directory (so two writers of one path never share it), fsync,
rename over the target, fsync the directory (so the rename survives a crash).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write"]


def atomic_write(path: str | os.PathLike, data: bytes, *, mode: int | None = None) -> None:
    """``mode``: the file's permissions (default 0600, ``mkstemp``'s)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)

"""Hashing a checkpoint's files while DCP writes them (issue 48; the record and the check: agent/shared/checkpoint_sums.py).

``HashingFileSystem`` is DCP's ``FileSystem`` whose write streams feed every byte they pass on to an XXH3 hasher:
the bytes are hashed once, from the buffer in hand, not read back, in the background of an async save (a large
write is hashed on a hashing thread while DCP's writer thread writes it; xxhash and the write both drop the GIL). A stream that is sought anywhere but where it stands (no DCP writer does that today) is hashed again
from the file once closed, so a sum is never wrong, only slower.
"""

from __future__ import annotations

import io
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystem

from trainwarden.agent.shared import checkpoint_sums

logger = logging.getLogger("trainwarden.runtime.checkpoint")

__all__ = ["HashingFileSystem", "verify_share"]


_OVERLAP_BYTES = 1 << 20  # a write this large is hashed on another thread while it is written (both drop the GIL)


class _HashingStream(io.RawIOBase):
    def __init__(self, raw, pool: ThreadPoolExecutor) -> None:
        super().__init__()
        self._raw, self._pool, self._hash, self.bytes, self.exact = raw, pool, checkpoint_sums.hasher(), 0, True

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        if len(view) < _OVERLAP_BYTES:
            n = self._raw.write(view)
            self._hash.update(view if n is None or n == len(view) else view[:n])
        else:  # the buffer is the caller's until this returns: hashed, in order, before it does
            hashed = self._pool.submit(self._hash.update, view)
            try:
                n = self._raw.write(view)
            finally:
                hashed.result()
            if n is not None and n != len(view):  # a short write (a raw file): hash what was written instead
                self._hash, self.exact = checkpoint_sums.hasher(), False
        self.bytes += len(view) if n is None else n
        return len(view) if n is None else n

    def tell(self) -> int:
        return self._raw.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        here = self._raw.tell()
        there = self._raw.seek(offset, whence)
        if there != here:
            self.exact = False  # bytes may be overwritten: hash the file once it is closed
        return there

    def flush(self) -> None:
        if not self._raw.closed:
            self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()

    def digest(self) -> str:
        return self._hash.hexdigest()


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _hashing_pool() -> ThreadPoolExecutor:
    """The process's hashing threads (created once; a save's writer threads share them)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="trainwarden-ckpt-hash")
        return _POOL


class HashingFileSystem(FileSystem):
    """DCP's local file system; each file written is hashed into ``sums`` ({file name: {"sum", "bytes"}})."""

    def __init__(self, sums: dict[str, dict]) -> None:
        super().__init__()
        self.sums = sums
        self._lock = threading.Lock()  # DCP may write with several threads
        self._pool = _hashing_pool()

    @contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _HashingStream(raw, self._pool)
            yield stream  # DCP closes it (after its fsync); the ``with`` closes it otherwise
        path = Path(path)
        if stream.exact:
            entry = {"sum": stream.digest(), "bytes": stream.bytes}
        else:
            digest, size = checkpoint_sums.file_sum(path)
            entry = {"sum": digest, "bytes": size}
        with self._lock:
            self.sums[path.name] = entry


def verify_share(path: Path, rank: int, world_size: int) -> list[str]:
    """This rank's share of the files of checkpoint ``path`` whose bytes differ from the sums in its commit marker
    (the caller gathers every rank's); [] when none is recorded, or when a file cannot be read: that is the
    storage's failure, not proof of corruption, and the load meets it and says so."""
    try:
        sums = checkpoint_sums.recorded_sums(path)
        share = sorted(sums)[rank::world_size] if sums else []
        if not share:
            return []
        return [str(m) for m in checkpoint_sums.verify(path, share, sums=sums)]
    except OSError as exc:
        logger.warning("could not verify the sums of %s: %s; loading it unverified", path, exc)
        return []

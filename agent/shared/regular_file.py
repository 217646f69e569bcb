"""Reading a file in a tree someone else writes: a regular file only, never through a link, never blocking, bounded.

Root reads files in a job's tree (a checkpoint's ``.metadata`` and manifest, the ``latest`` pointer, a set-aside
note, a Flight Recorder dump). ``read_regular`` opens the name with ``O_NOFOLLOW | O_NONBLOCK`` (a symbolic link
as the last component is refused, a FIFO never blocks), checks with ``fstat`` that what it opened is a regular file,
and reads at most ``limit`` bytes from that descriptor, so the file a job's user planted can neither point root at
another file nor stall it nor make it read without end (``/dev/zero``). With ``dir_fd`` the name is resolved in a
directory already opened the same way, so the directory cannot be swapped between the checks and the read.
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["NotARegularFile", "read_regular"]


class NotARegularFile(OSError):
    """A file root was to read in a job's tree is a symbolic link, a FIFO, a device or a directory, is larger than
    the bound or belongs to another uid than expected: it is not read. Retrying does not help; the job's user put it
    there."""


def read_regular(path: str | os.PathLike, limit: int, *, dir_fd: int | None = None, uid: int | None = None) -> bytes:
    """The bytes of ``path`` (relative to ``dir_fd`` when given), opened with ``O_NOFOLLOW | O_NONBLOCK``; raises
    ``NotARegularFile`` when it is a symbolic link or not a regular file or holds more than ``limit`` bytes (or,
    with ``uid``, belongs to another uid), ``FileNotFoundError`` when absent, another ``OSError`` when it cannot be
    read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the last component is a symbolic link
            raise NotARegularFile(f"{path} is a symbolic link; trainwarden never follows a link in a tree "
                                  "another user writes: replace it with the file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFile(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)}); only regular "
                                  "files are read there")
        if uid is not None and st.st_uid != uid:
            raise NotARegularFile(f"{path} belongs to uid {st.st_uid}, not {uid} who was to write it; it is not read")
        if st.st_size > limit:
            raise NotARegularFile(f"{path} holds {st.st_size} bytes, more than the {limit} read at most")
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise NotARegularFile(f"{path} grew past the {limit} bytes read at most while being read")
        return data
    finally:
        os.close(fd)

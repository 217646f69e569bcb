"""Reading inside a directory tree someone else controls, as root, without following their links.

A job's state directory belongs to the job's user (agent/node/job_user.py ``hand_over``). Whatever the root daemon
or an operator's root command still reads there goes through this module: a path is opened one component at a time
with ``openat`` and ``O_NOFOLLOW`` (a symlink anywhere on the way, the last component included, is refused with
``ELOOP``, never followed), directories with ``O_DIRECTORY`` and files with ``O_NONBLOCK`` (a FIFO planted where a
file was expected does not block the reader) and a regular-file check and a size bound before a byte is read
(``/dev/zero`` or a 100 GB file is not read without end). The model is kubelet's subPath resolution
(CVE-2017-1002101) and systemd-tmpfiles' refusal of unsafe path transitions.

Every refusal is an ``UntrustedPathError`` (an ``OSError``: callers that already treat an unreadable file as absent
keep doing so) that says which path and why.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["UntrustedPathError", "open_dir", "read_small", "read_small_text"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)


class UntrustedPathError(OSError):
    """A path in a tree someone else controls that will not be opened: a link, a special file, too large."""


def _components(path: Path, under: Path | None) -> tuple[str, list[str]]:
    path = Path(os.path.abspath(path))  # '..' taken away by its text: no link is followed, so that is the walk
    anchor = "/"
    if under is not None:
        under = Path(os.path.abspath(under))
        try:
            path = path.relative_to(under)
        except ValueError:
            raise UntrustedPathError(errno.EINVAL, f"{path} is not under {under}") from None
        anchor = str(under)
    return anchor, [part for part in path.parts if part not in ("", ".", "/")]


def open_dir(path: str | os.PathLike, *, under: str | os.PathLike | None = None) -> int:
    """A descriptor of directory ``path`` opened one component at a time, none a symlink (the caller closes it).
    ``under``: a directory of root's own above ``path`` (a state home), opened as usual (a link in the system's
    part of the path, /var/run for one, is fine); the walk starts there, else at ``/``. ``UntrustedPathError`` when
    a component is a link or not a directory; ``FileNotFoundError`` when one is missing."""
    anchor, parts = _components(Path(path), Path(under) if under is not None else None)
    fd = os.open(anchor, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for index, part in enumerate(parts):
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                where = os.path.join(anchor, *parts[:index + 1])
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UntrustedPathError(exc.errno, f"{where} is a symbolic link or not a directory; it is not "
                                                        f"followed") from None
                raise
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_small(path: str | os.PathLike, limit: int = 64 * 1024, *, under: str | os.PathLike | None = None) -> bytes:
    """The bytes of regular file ``path`` (at most ``limit`` of them), reached by ``open_dir`` of its parent and
    opened with ``O_NOFOLLOW|O_NONBLOCK``. ``UntrustedPathError`` for a link, a FIFO, a device, a directory or a
    file larger than ``limit``; ``FileNotFoundError`` when it is missing."""
    path = Path(path)
    parent = open_dir(path.parent, under=under)
    try:
        try:
            fd = os.open(path.name, _FILE_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UntrustedPathError(exc.errno, f"{path} is a symbolic link; it is not followed") from None
            raise
    finally:
        os.close(parent)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedPathError(errno.EINVAL, f"{path} is not a regular file; it is not read")
        if st.st_size > limit:
            raise UntrustedPathError(errno.EFBIG, f"{path} holds {st.st_size} bytes, more than the {limit} expected "
                                                  "of it; it is not read")
        chunks, total = [], 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:  # it grew meanwhile
                raise UntrustedPathError(errno.EFBIG, f"{path} holds more than the {limit} bytes expected of it")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_small_text(path: str | os.PathLike, limit: int = 64 * 1024, *,
                    under: str | os.PathLike | None = None) -> str:
    """``read_small`` decoded as UTF-8 (undecodable bytes replaced)."""
    return read_small(path, limit, under=under).decode("utf-8", "replace")

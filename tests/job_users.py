"""Running test processes as a second, unprivileged user (issue 30).

The interpreter often lives under a private home (``/root/.pyenv``, ``/root`` mode 0700): a process that drops to
``nobody`` cannot exec it or import the standard library. ``interpreter_for_others()`` gives a command prefix that
runs what follows in a mount namespace of its own where the directory in the way is covered by an empty tmpfs
(mode 0755) with only the interpreter's prefix mounted back at its own path; paths are unchanged, the host's mounts
are untouched, and every process started under it (the daemon, its launchers, their workers) sees the same view.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

__all__ = ["NOBODY", "interpreter_for_others", "shared_dir", "unavailable"]

NOBODY = "nobody"


def _blocking_dir(prefix: Path) -> Path | None:
    """The highest directory above ``prefix`` that others cannot enter (None: they reach it already)."""
    for parent in reversed(prefix.parents):
        if parent != Path("/") and not parent.stat().st_mode & stat.S_IXOTH:
            return parent
    return None


def unavailable() -> str | None:
    """Why this machine cannot run a test as a second user (None: it can)."""
    if os.geteuid() != 0:
        return "runs a job as a second user (uid nobody): needs root"
    if shutil.which("unshare") is None and _blocking_dir(Path(sys.base_prefix).resolve()) is not None:
        return "the interpreter is under a private directory and util-linux's unshare is missing"
    try:
        import pwd
        pwd.getpwnam(NOBODY)
    except KeyError:
        return "no user 'nobody' on this machine"
    return None


def interpreter_for_others() -> list[str]:
    """A command prefix under which every user can run this interpreter (module docstring); [] when they can."""
    prefix = Path(sys.base_prefix).resolve()
    blocking = _blocking_dir(prefix)
    if blocking is None:
        return []
    script = ('set -e; keep=$(mktemp -d); mount --bind "$1" "$keep"; '
              'mount -t tmpfs -o mode=0755,size=1m trainwarden-test "$2"; mkdir -p "$1"; mount --bind "$keep" "$1"; '
              'umount -l "$keep"; rmdir "$keep"; shift 2; exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh", str(prefix),
            str(blocking)]


def shared_dir(prefix: str) -> Path:
    """A fresh directory under /tmp that every user can enter (pytest's own are 0700); the caller removes it."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    return path

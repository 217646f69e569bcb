"""Checkpoints set aside: moved out of the ``step-*`` namespace whole, with a note saying why (``quarantine``),
listed (``list_set_aside``), deleted only when fenced and old (``quarantined_removable``), and put back by an
operator (``restore_aside``, by descriptor: root runs it in a directory the job's user owns).

The names are ``step-N.<state>[.k]`` (checkpoint_layout.py's docstring has the whole layout).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from trainwarden.agent.shared.atomic_file import atomic_write
from trainwarden.agent.shared.checkpoint_layout import (
    _ASIDE_RE, _SMALL_FILE_BYTES, COMMIT_MARKER, COMPLETE, FENCED, METADATA_NAME, CheckpointError, _classify_open,
    _exists, _open_dir, step_dir,
)
from trainwarden.agent.shared.regular_file import read_regular

__all__ = ["QUARANTINE_NOTE", "SetAside", "list_set_aside", "quarantine", "quarantined_removable", "restore_aside"]

logger = logging.getLogger(__name__)


QUARANTINE_NOTE = "QUARANTINE.json"


def quarantine(path: Path, *, state: str, reason: str) -> Path:
    """Move a checkpoint out of the ``step-*`` namespace, kept whole for inspection: ``step-N.<state>`` (a
    number appended if taken), with ``QUARANTINE.json`` inside saying why, when and who. Nothing is deleted."""
    target = path.with_name(f"{path.name}.{state}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.{state}.{n}")
    os.replace(path, target)
    note = {"state": state, "reason": reason, "time": time.time(), "host": os.uname().nodename, "pid": os.getpid(),
            "was": path.name}
    try:
        atomic_write(target / QUARANTINE_NOTE, json.dumps(note, indent=1).encode())
    except OSError as exc:
        logger.warning("quarantined %s as %s but could not write its note: %s", path, target, exc)
    return target


def quarantined_removable(directory: str | os.PathLike, older_than: int) -> list[tuple[Path, str]]:
    """Set-aside saves retention may delete, with what they are: only fenced ones (``step-N.fenced*``:
    written by a round that was no longer the job's, or while etcd could not confirm it), with N below
    ``older_than``, the newest complete checkpoint. Nothing restore set aside (unfinished, corrupt,
    unloadable, superseded) is ever deleted: it may be the run's only copy once the storage recovers."""
    return sorted((aside.path, "fenced checkpoint") for aside in list_set_aside(directory)
                  if aside.state == FENCED and aside.step < older_than)


@dataclass(frozen=True, kw_only=True)
class SetAside:
    """A ``step-N.<state>[.k]`` directory: a checkpoint or save moved out of the ``step-*`` namespace."""

    step: int
    state: str
    path: Path
    reason: str
    """From its QUARANTINE.json; empty when the note is missing or unreadable."""
    time: float | None
    """When it was set aside (UNIX seconds), from the note."""

    @property
    def had_metadata(self) -> bool:
        """Whether it ever was a finished save: DCP's ``.metadata`` or the commit marker is in it."""
        return any((self.path / name).exists() for name in (METADATA_NAME, COMMIT_MARKER))


def _set_aside_note(entry: Path) -> tuple[str, float | None]:
    """(reason, time) from ``entry``'s QUARANTINE.json; ("", None) when missing or unreadable. Never read through
    a link: the directory is the job user's."""
    if entry.is_symlink():
        return "a symbolic link, not a set-aside directory: its note was not read", None
    try:
        note = json.loads(read_regular(entry / QUARANTINE_NOTE, _SMALL_FILE_BYTES))
        return str(note.get("reason", "")), float(note.get("time") or 0) or None
    except (OSError, ValueError, TypeError, AttributeError):
        return "", None


def list_set_aside(directory: str | os.PathLike) -> list[SetAside]:
    """Every set-aside directory under ``directory``, newest step first, with the reason it was set aside."""
    directory = Path(directory)
    found = []
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return []
    for entry in entries:
        match = _ASIDE_RE.match(entry.name)
        if not match or not entry.is_dir():
            continue
        reason, when = _set_aside_note(entry)
        found.append(SetAside(step=int(match.group(1)), state=match.group(2), path=entry, reason=reason, time=when))
    return sorted(found, key=lambda a: (a.step, a.path.name), reverse=True)


def restore_aside(directory: str | os.PathLike, name: str, *, force: bool = False) -> tuple[Path, str]:
    """Put a set-aside checkpoint back as ``step-N`` (an operator, after fixing the storage): its new path and
    what ``classify`` finds in it now. Refused, naming what to do, when ``step-N`` exists, when ``name`` is not
    a set-aside directory, or when it is still not complete (unless ``force``).

    Root runs this in a directory the job's user owns, so every step is by descriptor: the checkpoint directory
    and the set-aside one are opened without following a link, ``classify`` reads the one opened, the renames are
    ``renameat`` within them; a link planted as the set-aside name (or swapped in meanwhile) is refused, never
    followed, so root renames nothing outside the tree."""
    directory = Path(directory)
    source = directory / name
    match = _ASIDE_RE.match(name)
    if not match or "/" in name:
        raise CheckpointError(f"{source} is not a set-aside checkpoint (step-NNNNNNNN.<state>); "
                              f"`trainwarden checkpoints` lists them")
    try:
        parent = _open_dir(directory)
    except OSError as exc:
        raise CheckpointError(f"{directory} cannot be opened as a directory of its own ({exc.strerror}): a "
                              "checkpoint directory is never reached through a link; give its real path with --dir") \
            from None
    try:
        try:
            aside = _open_dir(Path(name), dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise CheckpointError(f"{source} is a symbolic link or not a directory: a set-aside checkpoint is "
                                      "put back only from a directory of its own, never through a link") from None
            raise CheckpointError(f"{source} is not a set-aside checkpoint ({exc.strerror}); "
                                  f"`trainwarden checkpoints` lists them") from None
        try:
            return _restore_open(directory, parent, name, aside, int(match.group(1)), force)
        finally:
            os.close(aside)
    finally:
        os.close(parent)


def _restore_open(directory: Path, parent: int, name: str, aside: int, step: int, force: bool) -> tuple[Path, str]:
    target = step_dir(directory, step)
    if _exists(target.name, parent):
        raise CheckpointError(f"{target} exists: set it aside or remove it before putting {name} back")
    state, problems = _classify_open(directory / name, aside)
    if state != COMPLETE and not force:
        raise CheckpointError(f"{directory / name} is still {state}: {'; '.join(problems)[:500]}. Fix it first, or "
                              "put it back anyway with --force")
    os.rename(name, target.name, src_dir_fd=parent, dst_dir_fd=parent)
    moved, opened = os.stat(target.name, dir_fd=parent, follow_symlinks=False), os.fstat(aside)
    if (moved.st_dev, moved.st_ino) != (opened.st_dev, opened.st_ino):
        raise CheckpointError(f"{directory / name} was replaced while it was being put back: {target} is not the "
                              "directory that was checked; look at it before the job restores")
    if _exists(QUARANTINE_NOTE, aside):  # inside the directory opened above, wherever it is now
        os.rename(QUARANTINE_NOTE, f"{QUARANTINE_NOTE}.restored", src_dir_fd=aside, dst_dir_fd=aside)
    return target, state

"""On-disk layout of trainwarden checkpoints: naming, completeness, the ``latest`` pointer, retention.

Everything here works on plain directories and needs no process group, so the CLI and the agent can
inspect a checkpoint directory from outside the job.

Layout::

    <dir>/step-00000200/            one DCP checkpoint per saved step
        __0_0.distcp ...            DCP data, one file per rank (FileSystemWriter)
        trainwarden.json            manifest written by the coordinator before any data: step, world size,
                                    RNG keys
        rng-rank<R>.pt              per-rank RNG sidecar (see ``checkpoint.RNGState``), one per saved rank
        .metadata                   DCP metadata; the coordinator writes it last, after every rank's data
        COMMITTED                   written by the committing rank after validation, before the pointer: this
                                    directory was the job's checkpoint, so it is never an "unfinished save"
    <dir>/latest                    JSON pointer to the newest committed checkpoint {step, path, time, bytes}
    <dir>/step-00000300.unloadable  moved aside by restore: validated but failed to load, again and again
    <dir>/step-00000310.unfinished  moved aside by restore: a save newer than the one resumed that never
                                    finished (``.corrupt`` likewise); each holds QUARANTINE.json saying why
    <dir>/step-00000004.superseded  moved aside when a fresh start was allowed on purpose, so the new run's
                                    saves never overwrite it

Nothing restore sets aside is ever deleted (checkpoint_aside.py lists it and puts one back); the
only set-aside kind retention removes is ``.fenced`` (a stale round's save, older than the newest complete
checkpoint). A directory without ``.metadata`` that holds the ``COMMITTED`` marker is ``unreadable`` (its
metadata is missing: a lagging or damaged filesystem), never ``unfinished``.

Completeness (``validate``): ``.metadata`` exists and unpickles, every file it references is present with at
least the bytes it references, and, when the manifest lists RNG keys, every saved rank's sidecar is present.
The manifest and the sidecars are written before their rank enters DCP's planning collective, and
``.metadata`` only after every rank's data was written, so a directory with ``.metadata`` and all referenced
bytes was finished by every rank.

The pointer is written with write-tmp + fsync + rename + fsync(dir): readers see the old or the new pointer,
never a torn one. Retention (``choose_deletions``) is a pure function so its rules can be tested alone.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from trainwarden.agent.shared.atomic_file import atomic_write
from trainwarden.agent.shared.metadata_unpickler import MAX_METADATA_BYTES, MetadataRefused, load_metadata
from trainwarden.agent.shared.regular_file import NotARegularFile, read_regular

from typing import Iterable, Sequence

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "CheckpointSaveError",
    "CheckpointUnloadableError",
    "CheckpointStatus",
    "MANIFEST_NAME",
    "METADATA_NAME",
    "POINTER_NAME",
    "atomic_write",
    "choose_deletions",
    "COMMIT_MARKER",
    "find_complete",
    "info_for",
    "classify",
    "mark_committed",
    "read_latest",
    "read_manifest",
    "remove_checkpoint",
    "retention_candidates",
    "rng_sidecar_name",
    "scan",
    "step_dir",
    "validate",
    "write_latest",
]

logger = logging.getLogger(__name__)

POINTER_NAME = "latest"
MANIFEST_NAME = "trainwarden.json"
METADATA_NAME = ".metadata"
COMMIT_MARKER = "COMMITTED"
_STEP_RE = re.compile(r"^step-(\d{8,})$")
_ASIDE_RE = re.compile(r"^step-(\d{8,})\.([a-z]+)(?:\.(\d+))?$")

COMPLETE, UNFINISHED, UNREADABLE, CORRUPT = "complete", "unfinished", "unreadable", "corrupt"
UNLOADABLE = "unloadable"
"""Complete by its files, but loading it failed on every attempt (quarantined by restore)."""
FENCED = "fenced"
"""Complete on disk but written by a round that was no longer the job's (its commit was refused): set aside
so no restore takes it for the job's latest state."""
SUPERSEDED = "superseded"
"""Set aside when a fresh start was allowed on purpose (``--allow-fresh-start``): kept, never overwritten."""
"""What ``classify`` finds: complete; a save that never finished (no ``.metadata``); a checkpoint that could
not be read here (an I/O or permission error, or metadata classes this torch does not have: it may be fine
elsewhere or later); a checkpoint whose own bytes are wrong (garbage metadata, missing or short files)."""

# errors that say "this process cannot read it", not "the bytes are bad"
_UNREADABLE_ERRORS = (OSError, ImportError, AttributeError)
_SMALL_FILE_BYTES = 1 << 20
"""Most bytes read of a manifest, pointer or set-aside note (each a few hundred bytes)."""
_MAX_WORLD = 1 << 20
"""Most ranks whose sidecars a manifest can make ``classify`` look for."""


class CheckpointError(Exception):
    """Base class of checkpoint errors."""


class CheckpointNotFoundError(CheckpointError):
    """No complete, loadable checkpoint exists and one was required. Retrying does not help: point the job at
    a directory that holds one, or start without ``require=True``."""


class CheckpointUnloadableError(CheckpointError):
    """Checkpoints exist but none could be loaded; the job stops rather than silently train from step 1.
    Retrying does not help: fix or restore a checkpoint, or allow a fresh start on purpose."""


class CheckpointReadError(CheckpointUnloadableError):
    """Checkpoints exist but cannot be read here (an I/O error, a stale handle, a permission, a timeout, or a
    committed checkpoint whose ``.metadata`` is missing), after retries: not proof of corruption, so nothing
    is set aside and the job stops. Fix the storage, then resume; the checkpoints are where they were."""


class CheckpointSaveError(CheckpointError):
    """A save failed (disk full, I/O error, a rank died). The next save may succeed; the previous committed
    checkpoint is untouched."""


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """A complete checkpoint, as published in the ``latest`` pointer and to ``on_commit``."""

    step: int
    """Training step the checkpoint was saved at."""
    path: str
    """Absolute path of the checkpoint directory."""
    time: float
    """Wall-clock time (UNIX seconds) it was committed; for people and cross-host comparison only."""
    bytes: int
    """Total size of the checkpoint directory's files."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "CheckpointInfo":
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError(f"expected a JSON object, got {type(raw).__name__}")
        unknown = set(raw) - {"step", "path", "time", "bytes"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}")
        return cls(step=int(raw["step"]), path=str(raw["path"]), time=float(raw["time"]),
                   bytes=int(raw["bytes"]))


@dataclass(frozen=True, kw_only=True)
class CheckpointStatus:
    """One ``step-*`` directory and what ``validate`` found wrong with it (empty: complete)."""

    step: int
    """Step parsed from the directory name."""
    path: Path
    """The directory."""
    problems: tuple[str, ...]
    """Why it is incomplete; empty when complete."""
    state: str = COMPLETE
    """complete, unfinished, unreadable or corrupt (``classify``)."""

    @property
    def complete(self) -> bool:
        return not self.problems


def step_dir(directory: str | os.PathLike, step: int) -> Path:
    """``<directory>/step-<NNNNNNNN>``."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return Path(directory) / f"step-{step:08d}"


def rng_sidecar_name(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def _referenced_sizes(metadata) -> dict[str, int]:
    """File -> bytes the metadata says it must hold. Reads DCP's per-item storage info (relative_path,
    offset, length) by attribute: the class is private to torch, its fields are the documented format. A name
    that is not a plain file name in the checkpoint directory (DCP's writer writes ``__<rank>_<n>.distcp``) is
    refused, so metadata a job's user wrote cannot make a reader stat paths outside its checkpoint."""
    need: dict[str, int] = {}
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise ValueError("metadata has no storage_data map")
    for info in storage.values():
        rel, off, length = info.relative_path, int(info.offset), int(info.length)
        if not isinstance(rel, str) or rel in ("", ".", "..") or "/" in rel or "\0" in rel:
            raise ValueError(f"metadata references {rel!r}, which is not a file name in the checkpoint directory")
        need[rel] = max(need.get(rel, 0), off + length)
    return need


def _open_dir(path: Path, *, dir_fd: int | None = None) -> int:
    """A descriptor of checkpoint directory ``path`` (relative to ``dir_fd`` when given), opened without following
    a link or blocking."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def classify(path: str | os.PathLike) -> tuple[str, list[str]]:
    """(state, problems) of the checkpoint at ``path``; see the states above.

    Cheap: reads ``.metadata`` and the manifest, stats the data files, never reads tensor data. A complete
    checkpoint can still fail to load (bytes corrupted in place); ``Checkpointer.restore`` handles that.
    Safe on a directory someone else wrote (root runs it through ``trainwarden checkpoints`` and ``report``):
    the directory and its files are opened without following links or blocking, ``.metadata`` is read up to
    ``MAX_METADATA_BYTES`` and unpickled with the allow-list of ``metadata_unpickler``; metadata that names any
    other class is ``unreadable``, naming it, and nothing it names runs.
    """
    path = Path(path)
    try:
        dir_fd = _open_dir(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP or path.is_symlink():  # O_DIRECTORY on a link fails with ENOTDIR
            return UNREADABLE, [f"{path} is a symbolic link: a checkpoint is read only from a directory of its own, "
                                "never through a link; replace the link with the directory"]
        if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
            return CORRUPT, [f"{path} is not a directory"]
        return UNREADABLE, [f"{path}: cannot be read ({exc})"]
    try:
        return _classify_open(path, dir_fd)
    finally:
        os.close(dir_fd)


def _classify_open(path: Path, dir_fd: int) -> tuple[str, list[str]]:
    try:
        data = read_regular(METADATA_NAME, MAX_METADATA_BYTES, dir_fd=dir_fd)
    except FileNotFoundError:
        try:
            committed = _exists(COMMIT_MARKER, dir_fd)
        except OSError as exc:
            return UNREADABLE, [f"{path}: cannot be read ({exc})"]
        if committed:
            return UNREADABLE, [f"{path}: its {METADATA_NAME} is missing, but it was committed ({COMMIT_MARKER} "
                                "is there): the filesystem may be lagging or damaged"]
        return UNFINISHED, [f"{path}: no {METADATA_NAME} (the save did not finish; DCP's coordinator writes "
                            "it last)"]
    except NotARegularFile as exc:
        return UNREADABLE, [f"{path}: unreadable: {exc}"]
    except OSError as exc:
        return UNREADABLE, [f"{path}: cannot read {METADATA_NAME} here ({type(exc).__name__}: {exc}); the "
                            "checkpoint may be intact (an I/O or permission error)"]
    try:
        metadata = load_metadata(data)
        need = _referenced_sizes(metadata)
    except MetadataRefused as exc:
        return UNREADABLE, [f"{path}: unreadable: {exc} (it may hold code to run; remove the directory, or "
                            "check the class and add it to metadata_unpickler.ALLOWED_GLOBALS)"]
    except _UNREADABLE_ERRORS as exc:
        return UNREADABLE, [f"{path}: cannot read {METADATA_NAME} here ({type(exc).__name__}: {exc}); the "
                            "checkpoint may be intact (an I/O or permission error, or another torch version)"]
    except Exception as exc:  # pickle raises many types on garbage
        return CORRUPT, [f"{path}: unreadable {METADATA_NAME} ({type(exc).__name__}: {exc})"]
    try:
        problems = _file_problems(path, need, dir_fd)
    except OSError as exc:
        return UNREADABLE, [f"{path}: cannot stat its data files ({exc})"]
    return (CORRUPT if problems else COMPLETE), problems


def validate(path: str | os.PathLike) -> list[str]:
    """Problems that make the checkpoint at ``path`` unusable; an empty list means complete (``classify``)."""
    return classify(path)[1]


def _file_problems(path: Path, need: dict[str, int], dir_fd: int) -> list[str]:
    problems = []
    for rel, size in sorted(need.items()):
        try:
            st = os.stat(rel, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            problems.append(f"{path}: missing data file {rel} (referenced by {METADATA_NAME})")
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"{path}: data file {rel} is not a regular file ({stat.filemode(st.st_mode)})")
        elif st.st_size < size:
            problems.append(f"{path}: truncated data file {rel}: {st.st_size} bytes, metadata references {size}")
    problems.extend(_manifest_problems(path, dir_fd))
    return problems


def read_manifest(path: Path, *, dir_fd: int | None = None) -> dict | None:
    """The manifest of checkpoint ``path`` (or of the directory open as ``dir_fd``); None when absent (e.g. a
    plain DCP checkpoint). Read as ``read_regular`` reads: never through a link, never blocking, bounded."""
    try:
        text = read_regular(MANIFEST_NAME if dir_fd is not None else path / MANIFEST_NAME, _SMALL_FILE_BYTES,
                            dir_fd=dir_fd).decode()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc})") from None
    raw = json.loads(text)
    if not isinstance(raw, dict) or not isinstance(raw.get("world_size"), int):
        raise ValueError("manifest is not a JSON object with an integer world_size")
    return raw


def _manifest_problems(path: Path, dir_fd: int) -> list[str]:
    try:
        manifest = read_manifest(path, dir_fd=dir_fd)
    except (OSError, ValueError) as exc:
        return [f"{path}: unreadable {MANIFEST_NAME} ({exc})"]
    if manifest is None or not manifest.get("rng_keys"):
        return []
    problems = []
    for rank in range(min(manifest["world_size"], _MAX_WORLD)):
        name = rng_sidecar_name(rank)
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            empty = not stat.S_ISREG(st.st_mode) or st.st_size == 0
        except FileNotFoundError:
            empty = True
        if empty:
            problems.append(f"{path}: missing or empty RNG sidecar {name} "
                            f"(saved world size {manifest['world_size']})")
    return problems


def _dir_bytes(path: Path) -> int:
    total = 0
    for entry in path.iterdir():
        if entry.is_file():
            total += entry.stat().st_size
    return total


def scan(directory: str | os.PathLike) -> list[CheckpointStatus]:
    """Every ``step-*`` directory under ``directory``, newest step first, validated."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _STEP_RE.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    found.sort(key=lambda item: item[0], reverse=True)
    statuses = []
    for step, p in found:
        state, problems = classify(p)
        statuses.append(CheckpointStatus(step=step, path=p, problems=tuple(problems), state=state))
    return statuses


def info_for(status: CheckpointStatus) -> CheckpointInfo:
    meta = status.path / METADATA_NAME
    return CheckpointInfo(step=status.step, path=str(status.path.resolve()), time=meta.stat().st_mtime,
                          bytes=_dir_bytes(status.path))


def find_complete(directory: str | os.PathLike) -> list[CheckpointInfo]:
    """Complete checkpoints under ``directory``, newest first."""
    return [info_for(s) for s in scan(directory) if s.complete]


def write_latest(directory: str | os.PathLike, info: CheckpointInfo) -> Path:
    """Atomically point ``<directory>/latest`` at ``info``."""
    pointer = Path(directory) / POINTER_NAME
    atomic_write(pointer, (info.to_json() + "\n").encode())
    return pointer


def read_latest(directory: str | os.PathLike) -> CheckpointInfo | None:
    """The ``latest`` pointer; None when absent or unreadable (logged: the step directories are the truth,
    the pointer is a convenience for readers outside the job)."""
    pointer = Path(directory) / POINTER_NAME
    try:
        return CheckpointInfo.from_json(read_regular(pointer, _SMALL_FILE_BYTES).decode())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("ignoring unreadable checkpoint pointer %s (%s); find_complete() lists the real "
                       "checkpoints", pointer, exc)
        return None


def choose_deletions(entries: Iterable[tuple[int, str]], keep: int) -> list[int]:
    """Steps retention deletes, given ``(step, state)`` for each checkpoint directory (``classify``).

    Retention is the only deleter, and it deletes only what cannot be the only good copy: complete
    checkpoints beyond the newest ``keep`` (never fewer than one is kept, so a newer complete one always
    exists for what goes) and saves that never finished (no ``.metadata``) older than the newest complete
    one. Unreadable and corrupt checkpoints are never deleted (an unreadable one may be intact; a person
    decides), nor is anything newer than the newest complete one (a save may be in flight).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    entries = sorted(entries, key=lambda e: e[0], reverse=True)
    complete = [step for step, state in entries if state == COMPLETE]
    if not complete:
        return []
    newest = complete[0]
    doomed = set(complete[keep:])
    doomed.update(step for step, state in entries if state == UNFINISHED and step < newest)
    return sorted(doomed)


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint directory: rename it out of the ``step-*`` namespace first, so a crash halfway
    through leaves nothing that looks like a checkpoint."""
    doomed = path.with_name(f".deleting-{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def mark_committed(path: Path, step: int, *, sums: dict | None = None) -> None:
    """Write the commit marker into checkpoint ``path`` (after it validated, before the pointer names it), with
    the sums of its files where they were recorded (agent/shared/checkpoint_sums.py)."""
    record = {"step": step, "time": time.time(), **({"sums": sums} if sums else {})}
    atomic_write(path / COMMIT_MARKER, (json.dumps(record) + "\n").encode())


def retention_candidates(statuses: Sequence[CheckpointStatus], keep: int) -> list[CheckpointStatus]:
    doomed = set(choose_deletions(((s.step, s.state) for s in statuses), keep))
    return [s for s in statuses if s.step in doomed]

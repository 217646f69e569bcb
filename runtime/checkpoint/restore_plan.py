"""Rank 0's restore decision: which checkpoints to try, what was passed over, and whether the job may resume at all.

``plan_restore`` lists the ``step-*`` directories newest first and weighs what the job knows of its own
checkpoints (``resume_evidence``: the ``latest`` pointer, etcd's record through the node agent, set-aside
directories). A checkpoint that may be a read problem rather than a fact (unreadable, or the committed step's
directory without ``.metadata``: a lagging filesystem) is looked at again after each delay of the read backoff;
if it still cannot be read and it is newer than what would load, the plan is ``blocked``: nothing is set aside,
a read error is not corruption. Unfinished saves newer than anything that would load, and corrupt checkpoints
newer than the newest complete one, are set aside through the caller's ``quarantine``. The ``Checkpointer``
(runtime/checkpoint/checkpointer.py) broadcasts the plan and every rank follows it together.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from trainwarden.agent.shared import checkpoint_layout as store
from trainwarden.runtime.checkpoint import resume_evidence

__all__ = ["DEFAULT_READ_BACKOFF_S", "READ_BACKOFF_ENV", "RestorePlan", "plan_restore", "read_backoff_from_env"]

logger = logging.getLogger(__name__)

READ_BACKOFF_ENV = "TRAINWARDEN_CKPT_READ_BACKOFF_S"
DEFAULT_READ_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 15.0)
"""30 s in all: an NFS server restart or a stale handle's remount, not an outage."""


def read_backoff_from_env() -> tuple[float, ...]:
    """``TRAINWARDEN_CKPT_READ_BACKOFF_S="1,2,4"`` (seconds between looks), else ``DEFAULT_READ_BACKOFF_S``."""
    raw = os.environ.get(READ_BACKOFF_ENV, "").strip()
    if not raw:
        return DEFAULT_READ_BACKOFF_S
    try:
        delays = tuple(float(x) for x in raw.split(","))
    except ValueError:
        raise ValueError(f"{READ_BACKOFF_ENV}={raw!r}: expected seconds separated by commas, e.g. 1,2,4") from None
    if any(d < 0 for d in delays):
        raise ValueError(f"{READ_BACKOFF_ENV}={raw!r}: delays must be >= 0")
    return delays


@dataclass(frozen=True, kw_only=True)
class RestorePlan:
    """Rank 0's decision, broadcast to every rank."""

    candidates: list = field(default_factory=list)
    """(step, path) of complete checkpoints, newest first."""
    passed_over: list = field(default_factory=list)
    evidence: str = ""
    ever_committed: bool = False
    blocked: str = ""
    """Why the job may not resume at all (a read problem); empty otherwise."""
    error: str = ""
    memory_floor: int | None = None
    """When rank 0 keeps memory snapshots: the newest step the job committed or the disk holds complete (-1:
    none). A memory snapshot every rank has, of this step or a newer one, is restored first."""


def plan_restore(directory: Path, *, record: Callable[[], tuple[int | None, str]], read_backoff_s: tuple[float, ...],
                 keeps_memory: bool, quarantine: Callable[[int, Path, str, str], None]) -> RestorePlan:
    """What to try, what was passed over, and whether the job may not resume at all (module docstring).
    ``record`` asks for etcd's record of the job's checkpoint; ``quarantine(step, path, state, reason)`` sets
    a directory aside."""
    try:
        return _plan(directory, record(), read_backoff_s, keeps_memory, quarantine)
    except OSError as exc:
        return RestorePlan(error=f"cannot list checkpoints in {directory}: {exc}; check that it exists "
                                 "and is readable from every node (nothing was changed)")


def _plan(directory: Path, record: tuple[int | None, str], read_backoff_s: tuple[float, ...], keeps_memory: bool,
          quarantine: Callable[[int, Path, str, str], None]) -> RestorePlan:
    statuses, evidence = _scan_with_backoff(directory, record, read_backoff_s)
    complete = [s for s in statuses if s.complete]
    newest = complete[0].step if complete else -1
    committed = evidence.committed_step if evidence.committed_step is not None else -1
    doubtful = [s for s in _doubtful(statuses, evidence) if s.step > newest]
    if doubtful:
        return RestorePlan(evidence=evidence.describe(), ever_committed=True, blocked=(
            "checkpoints newer than any loadable one cannot be read after retrying for "
            f"{sum(read_backoff_s):.0f} s: {'; '.join('; '.join(s.problems) for s in doubtful)[:2000]}. "
            "Nothing was set aside: this is a storage problem (an I/O error, a stale handle, a permission, a "
            "lagging or half-restored filesystem), not proof of corruption. Fix the storage, then resume the job"))
    if committed > newest:
        logger.warning("the job committed step %d (%s), but no directory of that step is here; resuming from "
                       "the newest complete one (step %s)", committed, evidence.describe(), newest,
                       extra={"event": "checkpoint_missing"})
    passed_over = []
    for status in statuses:
        if status.complete or status.state == store.UNREADABLE:
            continue
        reason = "; ".join(status.problems)
        logger.warning("skipping incomplete checkpoint: %s", reason,
                       extra={"event": "checkpoint_incomplete", "step": status.step})
        if status.state == store.UNFINISHED:  # no checkpoint: it does not count as one that failed to load
            if status.step > max(newest, committed):  # the resumed run writes this step again
                quarantine(status.step, status.path, status.state, reason)
            continue
        passed_over.append(reason)
        if status.step > newest:  # corrupt: its own bytes are wrong
            quarantine(status.step, status.path, status.state, reason)
    return RestorePlan(candidates=[(s.step, str(s.path)) for s in complete], passed_over=passed_over,
                       evidence=evidence.describe(), ever_committed=bool(evidence.reasons()),
                       memory_floor=max(newest, committed) if keeps_memory else None)


def _doubtful(statuses, evidence) -> list[store.CheckpointStatus]:
    """What may be a read problem rather than a fact: unreadable checkpoints, and the committed step's
    directory when it has no ``.metadata`` (a committed checkpoint is never an unfinished save)."""
    committed = evidence.committed_step
    return [s for s in statuses if s.state == store.UNREADABLE
            or (s.state == store.UNFINISHED and committed is not None and s.step == committed)]


def _scan_with_backoff(directory: Path, record: tuple[int | None, str], read_backoff_s: tuple[float, ...]):
    """Scan; while something may be a read problem (``_doubtful``), look again after each backoff."""
    statuses = store.scan(directory)
    evidence = resume_evidence.gather(directory, statuses, record=record)
    for delay in read_backoff_s:
        doubtful = _doubtful(statuses, evidence)
        if not doubtful:
            break
        logger.warning("checkpoints in %s cannot be read yet (%s); looking again in %.1f s", directory,
                       "; ".join(p for s in doubtful for p in s.problems)[:500], delay)
        time.sleep(delay)
        statuses = store.scan(directory)
        evidence = resume_evidence.gather(directory, statuses, record=record)
    return statuses, evidence

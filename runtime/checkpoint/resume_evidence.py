"""What a job knows about its own checkpoints before it may start over: ``ResumeEvidence``.

A restore that finds nothing loadable must not decide "start from step 1" from the current scan alone: a
lagging shared filesystem, an NFS hiccup or an earlier restore's renames can hide every checkpoint a job
ever committed. So the committing rank weighs everything the job has (DESIGN: never start over by
accident):

- the ``latest`` pointer in the checkpoint directory (the step it names);
- the job's record in etcd, ``jobs/<job>/checkpoint``, asked of the node agent (``Session.committed_record``;
  unknown without an agent or while etcd is away);
- set-aside directories (``step-N.<state>``) that ever were finished saves: corrupt, unloadable, superseded,
  fenced ones, and unfinished ones at or below a committed step (a committed checkpoint an older trainwarden
  set aside as unfinished);
- complete or unreadable ``step-N`` directories still in place;
- the worker round (``TORCHELASTIC_RESTART_COUNT``): recorded with the decision, so an operator sees that a
  restarted round refused what its first round refused too.

Any one of them means the job has committed a checkpoint, and starting from step 1 then needs the explicit
``allow_fresh_start``. Pure data and one gathering function; the Checkpointer decides with it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from trainwarden.agent.shared import checkpoint_aside as asides
from trainwarden.agent.shared import checkpoint_layout as store

__all__ = ["ResumeEvidence", "gather"]

log = logging.getLogger(__name__)

_FINISHED_ASIDE = (store.CORRUPT, store.UNLOADABLE, store.SUPERSEDED, store.FENCED, store.UNREADABLE)


@dataclass(frozen=True, kw_only=True)
class ResumeEvidence:
    """Everything that says whether (and up to which step) the job has committed checkpoints."""

    pointer_step: int | None = None
    """Step the ``latest`` pointer names; None when absent or unreadable."""
    record_step: int | None = None
    """Step etcd's ``jobs/<job>/checkpoint`` names; None when absent or unknown (see ``record_source``)."""
    record_source: str = "not asked"
    """Where ``record_step`` came from, or why it is unknown (no agent, etcd unreachable)."""
    set_aside: tuple[asides.SetAside, ...] = ()
    """Set-aside directories that ever were finished saves, or unfinished ones at or below a committed step."""
    in_place: tuple[int, ...] = ()
    """Steps of ``step-N`` directories that are complete or unreadable (they exist, whatever loads)."""
    restart_count: int = 0
    """The worker round: 0 on the first attempt of this launch."""
    notes: tuple[str, ...] = field(default=())

    @property
    def committed_step(self) -> int | None:
        """The newest step the pointer or etcd says was committed."""
        known = [s for s in (self.pointer_step, self.record_step) if s is not None]
        return max(known) if known else None

    def reasons(self) -> list[str]:
        """Why this job is known to have committed a checkpoint; empty when nothing says so."""
        why = []
        if self.pointer_step is not None:
            why.append(f"the latest pointer names step {self.pointer_step}")
        if self.record_step is not None:
            why.append(f"etcd's job record names step {self.record_step}")
        if self.set_aside:
            names = ", ".join(a.path.name for a in self.set_aside[:6])
            more = f" and {len(self.set_aside) - 6} more" if len(self.set_aside) > 6 else ""
            why.append(f"set-aside checkpoints exist ({names}{more})")
        if self.in_place:
            why.append(f"checkpoint directories of steps {', '.join(map(str, self.in_place[:6]))} exist")
        return why

    def describe(self) -> str:
        """One line for logs and errors: the evidence and the attempt."""
        parts = self.reasons() or ["no checkpoint was ever committed"]
        parts.append(f"etcd's record: {self.record_source}")
        parts.append(f"worker round {self.restart_count}")
        return "; ".join(parts + list(self.notes))


def gather(directory: Path, statuses: Sequence[store.CheckpointStatus], *, record: tuple[int | None, str],
           env: os._Environ | dict | None = None) -> ResumeEvidence:
    """The evidence for ``directory``, given its scan and etcd's record as ``(step or None, source)``."""
    env = os.environ if env is None else env
    pointer = store.read_latest(directory)
    pointer_step = pointer.step if pointer is not None else None
    record_step, record_source = record
    committed = max([s for s in (pointer_step, record_step) if s is not None], default=None)
    aside = tuple(a for a in asides.list_set_aside(directory)
                  if a.state in _FINISHED_ASIDE or a.had_metadata
                  or (committed is not None and a.step <= committed))
    in_place = tuple(s.step for s in statuses if s.state in (store.COMPLETE, store.UNREADABLE))
    try:
        restart = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        restart = 0
    return ResumeEvidence(pointer_step=pointer_step, record_step=record_step, record_source=record_source,
                          set_aside=aside, in_place=in_place, restart_count=restart)

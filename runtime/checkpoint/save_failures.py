"""Failed checkpoint saves, said once a streak (issue 45, item 2: a full disk).

A checkpoint directory that fills up (ENOSPC) or hits its quota (EDQUOT) fails every save until space returns: one
save every few minutes, each one the same story. Before, each failed save logged an error and reported a failure to
the node agent, so a weekend of a full disk was hundreds of incidents, and the partial ``step-N`` directory of each
one stayed until the next commit's retention, holding the space the next save needed.

``SaveFailures`` is what the Checkpointer does when a save fails:

- the partial directory of that save is removed at once (rank 0, and only a directory this save created and that was
  never committed): nothing partial is ever a candidate, and its space is free for the next save;
- the first failure of a streak is said: an error line naming the cause (a full disk named as such) and one report to
  the agent (one incident, the failed-saves metric); the next ones of the same streak are a warning line each and no
  report, until a save commits again, which ends the streak with a line that says how many saves were lost;
- nothing here deletes a committed checkpoint: retention runs only after a commit, so the last good checkpoint stays
  the job's state for as long as saves fail, and the job keeps training.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass
from pathlib import Path

from trainwarden.agent.shared import checkpoint_layout as store
from trainwarden.runtime.checkpoint.errors import causes

logger = logging.getLogger("trainwarden.runtime.checkpoint")

__all__ = ["SaveFailures", "space_error"]

_SPACE = {errno.ENOSPC: "the checkpoint directory's file system is full (ENOSPC)",
          errno.EDQUOT: "the checkpoint directory's disk quota is exhausted (EDQUOT)"}


def space_error(exc: BaseException) -> str | None:
    """What ran out, when ``exc`` (or any exception it carries: DCP gathers each rank's) is a full disk or quota."""
    for e in causes(exc):
        if isinstance(e, OSError) and e.errno in _SPACE:
            return _SPACE[e.errno]
    return None


@dataclass
class _Streak:
    first_step: int
    failed: int = 1


class SaveFailures:
    """One Checkpointer's failed saves (module docstring). ``failed`` returns whether this failure is the first of
    its streak (the caller reports it to the agent only then); ``committed`` ends a streak."""

    def __init__(self, directory: Path, *, rank: int) -> None:
        self.directory, self.rank = Path(directory), rank
        self._streak: _Streak | None = None

    @property
    def in_streak(self) -> bool:
        return self._streak is not None

    def failed(self, step: int, path: Path, cause: str, exc: BaseException, *, advice: str | None = None) -> bool:
        self._remove_partial(step, path)
        space = space_error(exc)
        what = f"{space}: {cause}" if space else cause
        if self._streak is None:
            self._streak = _Streak(first_step=step)
            advice = advice or ("Free space there (or raise the quota); the next save after that commits."
                                if space else f"Check free space and permissions of {self.directory}.")
            logger.error("checkpoint save of step %d to %s failed: %s. Training continues; the latest committed "
                         "checkpoint is unchanged and is never deleted to make room. %s Further failures are "
                         "logged as warnings until a save commits again.", step, path, what, advice,
                         extra={"event": "checkpoint_failed", "step": step})
            return True
        self._streak.failed += 1
        logger.warning("checkpoint save of step %d failed again (%d failed since step %d): %s", step,
                       self._streak.failed, self._streak.first_step, what,
                       extra={"event": "checkpoint_failed", "step": step})
        return False

    def committed(self, step: int) -> None:
        if self._streak is not None:
            logger.info("checkpoint saves work again: step %d committed after %d failed save(s) since step %d",
                        step, self._streak.failed, self._streak.first_step)
            self._streak = None

    def _remove_partial(self, step: int, path: Path) -> None:
        """Rank 0 removes what this save left: its own ``step-N`` directory, never one that was committed."""
        if self.rank != 0 or path != store.step_dir(self.directory, step):
            return
        try:
            if not path.is_dir() or path.is_symlink() or (path / store.COMMIT_MARKER).exists():
                return
            store.remove_checkpoint(path)
            logger.info("removed the partial save of step %d (%s)", step, path)
        except OSError as exc:
            logger.warning("could not remove the partial save %s: %s; retention removes it after the next commit",
                           path, exc)

"""Where trainwarden keeps a job's state on the local disk.

A job's state directory holds its checkpoints (unless the script is told otherwise), logs, fault
markers and incident records, and outlives the run so that `trainwarden incidents` and a resume
can read it afterwards. Default: ``$TRAINWARDEN_STATE_HOME/jobs/<job>``, where
``TRAINWARDEN_STATE_HOME`` defaults to ``$XDG_STATE_HOME/trainwarden`` (``~/.local/state/trainwarden``).
"""

from __future__ import annotations

import os
from pathlib import Path

from trainwarden.agent.common.untrusted_fs import read_small_text
from trainwarden.agent.shared.contract import JOB_NAME_RE, validate_job_name  # the one rule, shared with workers

__all__ = ["CHECKPOINT_DIR_RECORD", "JOB_NAME_RE", "default_checkpoint_dir", "default_state_home", "job_checkpoint_dir",
           "job_records_dir",
           "job_state_dir", "records_home",
           "validate_job_name"]



def default_state_home(env=os.environ) -> Path:
    if env.get("TRAINWARDEN_STATE_HOME"):
        return Path(env["TRAINWARDEN_STATE_HOME"])
    xdg = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(xdg) / "trainwarden"


CHECKPOINT_DIR_RECORD = "checkpoint_dir"
"""The file in a job's state directory naming its checkpoint directory (written by `trainwarden run`, kept after
the run so `trainwarden checkpoints --job J` finds a directory given with the script's --ckpt-dir)."""


def job_checkpoint_dir(job: str, state_home: str | os.PathLike | None = None) -> Path:
    """Where job ``job`` keeps its checkpoints on this node: what its last run recorded, else the default."""
    state = job_state_dir(job, state_home)
    try:  # the job's user writes this file: read without following a link, a FIFO or a huge file (root may read it)
        recorded = read_small_text(state / CHECKPOINT_DIR_RECORD, 4096, under=state.parent).strip()
    except OSError:
        recorded = ""
    return Path(recorded) if recorded else default_checkpoint_dir(state)


def default_checkpoint_dir(state_dir: Path) -> Path:
    """Where a job's workers checkpoint when nobody said otherwise (their ``TRAINWARDEN_CHECKPOINT_DIR``)."""
    return state_dir / "checkpoints"


def job_state_dir(job: str, state_home: str | os.PathLike | None = None) -> Path:
    return Path(state_home or default_state_home()) / "jobs" / validate_job_name(job)


def records_home(state_home: str | os.PathLike | None = None) -> Path:
    """Where the node daemon (root) keeps what it records about jobs: ``<state home>/daemon/records``."""
    return Path(state_home or default_state_home()) / "daemon" / "records"


def job_records_dir(job: str, state_home: str | os.PathLike | None = None) -> Path:
    """The node daemon's records about job ``job`` (its incidents, refusals, diagnostics), in directories root owns
    and the job's user may read: never inside the job's state directory, which is the user's (a link there would
    make root write wherever the user points it)."""
    return records_home(state_home) / validate_job_name(job)

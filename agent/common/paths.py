"""Where trainwarden keeps a job's state on the local disk.

A job's state directory holds its checkpoints (unless the script is told otherwise), logs, fault
markers and incident records, and outlives the run so that `trainwarden incidents` and a resume
can read it afterwards. Default: ``$TRAINWARDEN_STATE_HOME/jobs/<job>``, where
``TRAINWARDEN_STATE_HOME`` defaults to ``$XDG_STATE_HOME/trainwarden`` (``~/.local/state/trainwarden``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["JOB_NAME_RE", "default_state_home", "job_state_dir", "validate_job_name"]

JOB_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")


def validate_job_name(name: str) -> str:
    """Job names become etcd keys, directory names and metric labels: keep them tame."""
    if not JOB_NAME_RE.match(name):
        raise ValueError(
            f"job name {name!r} is invalid: use 1-63 lowercase letters, digits, '.', '_' or '-', "
            "starting and ending with a letter or digit"
        )
    return name


def default_state_home(env=os.environ) -> Path:
    if env.get("TRAINWARDEN_STATE_HOME"):
        return Path(env["TRAINWARDEN_STATE_HOME"])
    xdg = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(xdg) / "trainwarden"


def job_state_dir(job: str, state_home: str | os.PathLike | None = None) -> Path:
    return Path(state_home or default_state_home()) / "jobs" / validate_job_name(job)

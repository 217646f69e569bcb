"""Who may read what about a job through the agent's socket (issue 44, round 2).

Everyone in the socket's group can call ``Status`` (``trainwarden status``, ``top``) and ``CheckpointRecord`` (a
restore's question: what etcd says the job committed, which memory snapshots the agent holds). Those answers are
about jobs, and a job belongs to the kernel's uid of its first verified stream (``JobTelemetry.connect``). So the
caller proves its uid the way a worker does, with a single-use peer token from ``<socket>.cred`` in the call's
metadata (agent/shared/peer_token.py), and:

- root, and the agent's own user, see every job (an operator uses ``sudo trainwarden status``);
- any other verified uid sees the jobs it owns, and jobs no verified stream owns (their telemetry is anyone's
  claim: ``--allow-unverified-streams``);
- a caller without a token sees only such unowned jobs; one with an unknown or used token is refused.

A job the caller may not see is left out of ``Status`` as if absent, and ``CheckpointRecord`` answers "unknown"
for it, never its committed step, path or snapshots.
"""

from __future__ import annotations

import os
from typing import Callable

__all__ = ["ANONYMOUS", "ReadAccess"]

ANONYMOUS = None
"""The caller's uid when it sent no token."""


class ReadAccess:
    """Whether a caller of uid ``uid`` (``ANONYMOUS`` without a token) may read about a job owned by a uid."""

    def __init__(self, owner_of: Callable[[str], int | None], *, agent_uid: int | None = None) -> None:
        """``owner_of``: the job's owning uid, None when no verified stream owns it (``JobTelemetry.owner_uid``)."""
        self._owner_of = owner_of
        self._agent_uid = os.geteuid() if agent_uid is None else agent_uid

    def sees_all(self, uid: int | None) -> bool:
        return uid is not None and uid in (0, self._agent_uid)

    def may_see(self, uid: int | None, job: str) -> bool:
        if self.sees_all(uid):
            return True
        owner = self._owner_of(job)
        return owner is None or owner == uid

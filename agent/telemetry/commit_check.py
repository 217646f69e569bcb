"""Who may commit a checkpoint for a rank, and the launcher's word on whether it may be published.

The ``Commit`` RPC asks before a rank publishes a checkpoint as the job's latest. Two checks, in order:

- `commit_identity`: the asker must be the process whose stream holds the rank, by the request's own single-use peer
  token (agent/telemetry/peer_credentials.py); without a token only where the agent allows unverified workers. A rank
  with no stream leaves the decision to the guard (which refuses pid 0); a rank held by an unverified stream has no
  identity to compare.
- `guarded_commit`: the guard the launcher of a multi-node job sets (``TelemetryServer.commit_guard``: is the job
  still in this round?) gets the pid the kernel vouched for on the rank's stream, never a pid the request claims. A
  guard that cannot decide refuses: publishing is what a fence forbids.
"""

from __future__ import annotations

import logging
from typing import Callable

from trainwarden.agent.shared import telemetry_pb2 as pb
from trainwarden.agent.telemetry.snapshots import WorkerInfo

__all__ = ["UNVERIFIED", "CommitGuard", "commit_identity", "guarded_commit"]

log = logging.getLogger(__name__)

UNVERIFIED = ("{what} without a peer token: this agent requires peer credentials; fetch a single-use token from "
              "{path} first and send it (trainwarden.runtime does), or start the agent with "
              "--allow-unverified-streams to accept unverified workers (never signalled)")
"""Why a Hello or a Commit without a peer token is refused (``what``, ``path``: the ``.cred`` socket)."""

CommitGuard = Callable[[str, int, int, int, str, int], "str | None"]
"""``(job, rank, pid, step, path, bytes) -> None`` to allow a commit, or why it is refused."""


def commit_identity(request, holder: WorkerInfo | None, take: Callable, *, allow_unverified: bool,
                    cred_path: str) -> str | None:
    """Why the process asking may not commit for the rank (it is not the one whose stream holds it), or None.
    `holder`: who the rank's stream is (None: it has none); `take`: the peer-token store's ``take``."""
    cred = None
    if request.peer_token:
        cred = take(request.peer_token)
        if cred is None:
            return ("unknown, used or expired peer token: fetch a new one from the agent's .cred socket for every "
                    "Commit")
    elif not allow_unverified:
        return "no peer token: " + UNVERIFIED.format(what="a Commit", path=cred_path)
    if holder is None or not holder.verified:
        return None
    if cred is None or (cred.pid, cred.started) != (holder.pid, holder.started):
        asker = f"pid {cred.pid} uid {cred.uid}" if cred is not None else "an unverified process"
        return (f"rank {request.rank} of job {request.job} streams from pid {holder.pid} (uid {holder.uid}); "
                f"{asker} may not commit for it: only the process whose stream holds the rank may")
    return None


def guarded_commit(guard: CommitGuard | None, request, pid: int) -> pb.CommitReply:
    """The guard's answer for the rank's stream's `pid` (0: none); no guard allows every commit."""
    if guard is None:
        return pb.CommitReply(allowed=True)
    try:
        refusal = guard(request.job, request.rank, pid, request.step, request.path, request.bytes)
    except Exception as exc:  # a guard that cannot decide refuses: publishing is what a fence forbids
        log.exception("commit check of job %s step %d failed", request.job, request.step)
        refusal = f"the agent could not check the job's round: {exc}"
    return pb.CommitReply(allowed=refusal is None, reason=refusal or "")

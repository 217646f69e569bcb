"""The replies of the telemetry server's reading RPCs, made from what the agent holds.

``Status`` (``trainwarden status/top``) gets one `job_status` per job the caller may see, from the store's
snapshots; ``CheckpointRecord`` (a restore's evidence before any fresh start) gets `checkpoint_record_reply`, from
etcd's ``jobs/<job>/checkpoint`` through the source the launcher sets. Who may read what is decided by the server
(agent/telemetry/read_access.py).
"""

from __future__ import annotations

import logging
from typing import Callable

from trainwarden.agent.shared import telemetry_pb2 as pb
from trainwarden.agent.telemetry.snapshots import JobSnapshot, steps_from

__all__ = ["CheckpointRecordSource", "checkpoint_record_reply", "job_status"]

log = logging.getLogger(__name__)

CheckpointRecordSource = Callable[[str], "dict | None"]
"""``job -> etcd's checkpoint record`` (a dict with ``step``), None when none is recorded; raises when etcd
cannot be read."""


def job_status(job: JobSnapshot, now: float) -> pb.JobStatus:
    """A job's line in the Status reply (``trainwarden status/top``): its ranks, and the job's step, step times,
    throughput and flags over them."""
    status = pb.JobStatus(job=job.job, world_size=job.world_size, mesh=dict(job.mesh),
                          checkpoint_last_step=job.checkpoint_last_step)
    flags: set[str] = set()
    for r in job.ranks:
        status.ranks.append(pb.RankStatus(
            rank=r.rank, local_rank=r.local_rank, pid=r.pid, hostname=r.hostname, connected=r.connected,
            last_step=r.last_step, last_seen_seconds_ago=max(0.0, now - r.last_seen_monotonic),
            step_p50_seconds=r.step_p50_seconds, step_p99_seconds=r.step_p99_seconds,
            wait_share=r.wait_share, tokens_per_second=r.tokens_per_second,
            restart_count=r.restart_count, flags=list(r.flags), straggler_score=r.straggler_score))
        flags.update(r.flags)
    if job.ranks:
        p50s = sorted(r.step_p50_seconds for r in job.ranks)
        status.last_step = max(r.last_step for r in job.ranks)
        status.step_p50_seconds = p50s[len(p50s) // 2]
        status.step_p99_seconds = max(r.step_p99_seconds for r in job.ranks)
        status.tokens_per_second = sum(r.tokens_per_second for r in job.ranks)
    else:
        status.last_step = -1
    status.flags.extend(sorted(flags))
    status.steps_from = steps_from(job.ranks)
    return status


def checkpoint_record_reply(source: "CheckpointRecordSource | None", job: str) -> pb.CheckpointRecordReply:
    """What etcd's record (read by `source`) says the job committed: unknown when there is no source, etcd cannot
    be read or the record is malformed, never an error."""
    if source is None:
        return pb.CheckpointRecordReply(known=False, source="this agent has no etcd record of the job")
    try:
        record = source(job)
    except Exception as exc:  # etcd away: unknown, never a refusal to answer
        log.warning("cannot read the checkpoint record of job %s: %s", job, exc)
        return pb.CheckpointRecordReply(known=False, source=f"etcd could not be read: {exc}"[:500])
    if record is None:
        return pb.CheckpointRecordReply(known=True, found=False, source="none recorded")
    try:
        step = int(record["step"])
    except (KeyError, TypeError, ValueError):
        return pb.CheckpointRecordReply(known=False, source=f"etcd's record is malformed: {record!r}"[:500])
    return pb.CheckpointRecordReply(known=True, found=True, step=step, path=str(record.get("path", ""))[:4096],
                                    source="found")

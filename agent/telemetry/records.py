"""Worker records into the telemetry store: the protobuf messages of a stream turned into `JobTelemetry`'s plain calls.

Records with bad values inside a well-formed stream (negative durations, unknown stages, a rank outside the world)
are counted as "invalid" (``JobTelemetry.count_rejected``) and skipped; the stream goes on. Strings are cut to the
lengths the store keeps. The server (agent/telemetry/server.py) decides who a stream speaks for; this module only
reads what it says.
"""

from __future__ import annotations

import logging
import math

from trainwarden.agent.shared import telemetry_pb2 as pb
from trainwarden.agent.shared.contract import CHECKPOINT_STAGES, MAX_STEP_SEND_S, NUMERIC_KINDS
from trainwarden.agent.telemetry.arrivals import Arrival
from trainwarden.agent.telemetry.job_telemetry import JobTelemetry
from trainwarden.agent.telemetry.snapshots import CollectiveTotals, WorkerInfo

__all__ = ["STAGE_NAMES", "apply_record", "worker_info"]

log = logging.getLogger(__name__)

STAGE_NAMES = {getattr(pb, s.upper()): s for s in CHECKPOINT_STAGES}
"""The protobuf's checkpoint stage numbers to the stage names of the contract."""


def _apply_arrivals(js: JobTelemetry, info: WorkerInfo, a: pb.Arrivals) -> None:
    """Collective arrivals for straggler matching; an inconsistent batch is refused whole."""
    n = len(a.group)
    if len(a.seq) != n or len(a.enqueued_ns) != n or any(g < 0 or g >= len(a.groups) for g in a.group) \
            or (a.op and (len(a.op) != n or any(o < 0 or o >= len(a.ops) for o in a.op))) \
            or any(not 0 <= r < max(1, info.world_size) for m in a.members for r in m.ranks):
        js.count_rejected("invalid")
        return
    groups, ops = list(a.groups), list(a.ops)
    op_of = (ops[o] for o in a.op) if a.op else iter(lambda: "", None)
    arrivals = [Arrival(groups[g], seq, t, next(op_of)) for g, seq, t in zip(a.group, a.seq, a.enqueued_ns)]
    js.record_arrivals(info.job, info.rank, arrivals, continues=a.continues,
                       members={m.name: list(m.ranks) for m in a.members})


def apply_record(js: JobTelemetry, info: WorkerInfo, message: pb.WorkerMessage) -> None:
    """One record of the stream of `info`'s worker, into the store; a record with bad values is counted
    ("invalid") and skipped."""
    kind = message.WhichOneof("record")
    job, rank = info.job, info.rank
    if kind in ("step", "steps"):
        for s in (message.step,) if kind == "step" else message.steps.steps:
            if not (math.isfinite(s.duration_seconds) and s.duration_seconds >= 0 and s.index >= 0):
                js.count_rejected("invalid")
                continue
            js.record_step(job, rank, index=s.index, start_unix=s.start_unix,
                           duration_seconds=s.duration_seconds, tokens=s.tokens)
        if kind == "steps":  # after its steps: a promise covers what comes after them
            within = message.steps.next_within_seconds
            if not (math.isfinite(within) and 0 <= within <= MAX_STEP_SEND_S):
                js.count_rejected("invalid")
                within = 0.0
            js.record_steps_promise(job, rank, within)
    elif kind == "collectives":
        totals = [CollectiveTotals(process_group=c.process_group, op=c.op, count=c.count,
                                   wait_seconds=c.wait_seconds, last_seq_id=c.last_seq_id)
                  for c in message.collectives.ops
                  if c.count >= 0 and math.isfinite(c.wait_seconds) and c.wait_seconds >= 0]
        if len(totals) != len(message.collectives.ops):
            js.count_rejected("invalid")
        js.record_collectives(job, rank, totals, has_durations=message.collectives.has_durations)
        if not message.collectives.has_durations and message.collectives.HasField("arrivals"):
            _apply_arrivals(js, info, message.collectives.arrivals)
    elif kind == "checkpoint":
        c = message.checkpoint
        stage = STAGE_NAMES.get(c.stage)
        if stage is None or not math.isfinite(c.seconds):
            js.count_rejected("invalid")
            return
        js.record_checkpoint(job, rank, stage=stage, step=c.step, seconds=c.seconds, bytes_=c.bytes, path=c.path[:4096],
                             detail=c.detail[:2000])
    elif kind == "numeric":
        n = message.numeric
        if n.kind not in NUMERIC_KINDS or n.step < 0 or not -1 <= n.first_rank < max(1, info.world_size):
            js.count_rejected("invalid")
            return
        js.record_numeric(job, rank, kind=n.kind, step=n.step, first_rank=n.first_rank, action=n.action[:64],
                          detail=n.detail[:2000])
    elif kind == "stats":
        js.record_client_stats(job, rank, dropped=message.stats.dropped)
    elif kind == "training_thread":
        t = message.training_thread
        if not all(math.isfinite(v) and 0 <= v < 1e7 for v in (t.still_seconds, t.collective_pending_seconds)):
            js.count_rejected("invalid")
            return
        js.record_training_thread(job, rank, still_seconds=t.still_seconds,
                                  collective_pending_seconds=t.collective_pending_seconds)
    elif kind == "goodbye":
        js.goodbye(job, rank, info.pid, message.goodbye.reason)
        log.debug("job %s rank %d said goodbye: %s", job, rank, message.goodbye.reason[:200],
                  extra={"job": job, "rank": rank})
    elif kind == "hello":  # a later Hello updates what the worker says of itself (mesh, step source)
        h = message.hello
        if (h.job, h.rank) != (job, rank) or (h.pid != info.pid and not info.verified) or len(h.mesh) > 8:
            js.count_rejected("invalid")  # a stream speaks for one worker
            return
        js.update_worker(job, rank, info.pid, mesh=dict(h.mesh), step_source=h.step_source[:32],
                         gpu_uuid=h.gpu_uuid[:96])
    else:
        js.count_rejected("invalid")


def worker_info(hello: pb.Hello) -> WorkerInfo | None:
    """Who a Hello says its worker is, None when it breaks the rules (no job, a rank outside the world, a mesh of
    more than 8 dimensions); the server then puts the kernel's word for the pid and uid in."""
    if not hello.job or len(hello.job) > 128 or hello.rank < 0 or hello.world_size < 1 \
            or hello.rank >= hello.world_size or len(hello.mesh) > 8:
        return None
    return WorkerInfo(job=hello.job, rank=hello.rank, local_rank=hello.local_rank,
                      world_size=hello.world_size, mesh=dict(hello.mesh), pid=hello.pid,
                      restart_count=hello.restart_count, hostname=hello.hostname[:256],
                      step_source=hello.step_source[:32], gpu_uuid=hello.gpu_uuid[:96])

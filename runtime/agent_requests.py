"""One-shot requests of a worker to its node agent, each on a channel of its own, off the training thread's hot path:
the stream's peer token (``fetch_peer_token``), whether a checkpoint may be committed (``ask_commit``), what etcd
says was committed and which memory snapshots the agent vouches for (``ask_checkpoint_record``,
``ask_memory_steps``, ``ask_memory_held``). Each answers "no agent" rather than raise when none listens.
The stream itself is agent_client.py's.
"""

from __future__ import annotations

import logging
import os

import grpc

from trainwarden.agent.shared import contract
from trainwarden.agent.shared import telemetry_pb2 as pb
from trainwarden.agent.shared.peer_token import fetch_peer_token, token_metadata

__all__ = ["ask_checkpoint_record", "ask_commit", "ask_memory_held", "ask_memory_steps", "fetch_peer_token"]

log = logging.getLogger(__name__)


def ask_commit(socket_path: str, request: pb.CommitRequest, timeout: float = 30.0) -> pb.CommitReply | None:
    """The agent's answer to a Commit request; None when no agent answers (none listens, it is restarting,
    or it predates the RPC). An agent that is there but does not decide within ``timeout`` (etcd slow) is a
    refusal. Off the hot path: the checkpoint's commit thread calls it, once per save."""
    if not os.path.exists(socket_path):
        return None
    asked = pb.CommitRequest()
    asked.CopyFrom(request)
    asked.peer_token = fetch_peer_token(socket_path)  # the agent answers only the process whose stream holds the rank
    request = asked
    channel = grpc.insecure_channel(f"unix:{socket_path}", options=[("grpc.enable_retries", 0)])
    try:
        call = channel.unary_unary(contract.COMMIT_METHOD, request_serializer=pb.CommitRequest.SerializeToString,
                                   response_deserializer=pb.CommitReply.FromString)
        return call(request, timeout=timeout)
    except grpc.RpcError as exc:
        if hasattr(exc, "code") and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return pb.CommitReply(allowed=False, reason=f"the node agent could not check the job's round within "
                                                        f"{timeout:.0f} s")
        log.warning("the agent did not answer whether checkpoint step %d may be committed (%s)", request.step,
                    exc.code() if hasattr(exc, "code") else exc)
        return None
    finally:
        channel.close()


def _checkpoint_record(socket_path: str, request, timeout: float):
    """The agent's CheckpointRecordReply, or why there is none (a string)."""
    if not os.path.exists(socket_path):
        return "no node agent"
    channel = grpc.insecure_channel(f"unix:{socket_path}", options=[("grpc.enable_retries", 0)])
    try:
        call = channel.unary_unary(contract.CHECKPOINT_RECORD_METHOD,
                                   request_serializer=pb.CheckpointRecordRequest.SerializeToString,
                                   response_deserializer=pb.CheckpointRecordReply.FromString)
        # the token says whose process asks: an agent answers only about a job of the asker's uid
        return call(request, timeout=timeout, metadata=token_metadata(socket_path))
    except grpc.RpcError as exc:
        return f"the node agent did not answer: {exc.code() if hasattr(exc, 'code') else exc}"
    finally:
        channel.close()


def ask_checkpoint_record(socket_path: str, job: str, timeout: float = 10.0) -> tuple[int | None, str, str]:
    """(step, path, source) of what etcd's job record says was committed, asked of the agent; (None, "", why)
    when none is recorded or it is unknown (no agent, no etcd, a timeout). Once per restore, off the hot path."""
    reply = _checkpoint_record(socket_path, pb.CheckpointRecordRequest(job=job), timeout)
    if isinstance(reply, str):
        return None, "", f"unknown ({reply})"
    if not reply.known:
        return None, "", f"unknown ({reply.source})"
    return (int(reply.step) if reply.found else None), reply.path, reply.source


def ask_memory_steps(socket_path: str, job: str, world_size: int, rank: int, timeout: float = 10.0) -> list[int]:
    """The steps of ``rank``'s memory snapshots at ``world_size`` that the agent owning the memory holds, newest
    first; empty when there are none or no agent answers. Once per restore, off the hot path."""
    reply = _checkpoint_record(socket_path, pb.CheckpointRecordRequest(job=job, world_size=int(world_size),
                                                                      rank=int(rank)), timeout)
    return [] if isinstance(reply, str) else [int(s) for s in reply.memory_steps]


def ask_memory_held(socket_path: str, job: str, world_size: int, rank: int,
                    timeout: float = 10.0) -> list[tuple[int, int, int]]:
    """(world size, rank, step) of every memory snapshot file the agent owning the memory vouches for, of every
    rank on its node; an older agent that answers only for the asking rank gives that rank's files at
    ``world_size``. Empty when there are none or no agent answers. Once per restore, off the hot path."""
    reply = _checkpoint_record(socket_path, pb.CheckpointRecordRequest(job=job, world_size=int(world_size),
                                                                      rank=int(rank), all_memory=True), timeout)
    if isinstance(reply, str):
        return []
    if reply.memory_held:
        return [(int(f.world_size), int(f.rank), int(f.step)) for f in reply.memory_held]
    return [(int(world_size), int(rank), int(s)) for s in reply.memory_steps]

"""The agent's telemetry endpoint: a gRPC server on a unix socket that workers stream to.

Each worker (trainwarden.runtime) holds one bidirectional `Stream`: it sends a Hello, then step,
collective, checkpoint and statistics records; the agent sends commands back (`send_command`). A unary
`Status` serves `trainwarden status/top`, and the standard gRPC health service answers probes.

Design:

- Sync grpc server. A stream occupies one pool thread (the response generator, which waits on the
  stream's command queue) plus one reader thread of ours that feeds `JobTelemetry`. `max_streams` bounds both,
  and `max_streams_per_uid` what one uid may hold; a stream that sends no Hello within `hello_timeout_s` is
  cancelled (agent/telemetry/admission.py). A stream beyond a cap is refused at once with RESOURCE_EXHAUSTED and
  the cap named; the pool keeps `_RESERVED_THREADS` beyond `max_streams`, so the health check, `Status` and
  `Commit` are answered however many streams are open.
- Bad input never raises through gRPC's machinery. Our request deserializer returns a `_Rejected` marker
  instead of raising (gRPC would otherwise abort with INTERNAL and nothing would be counted); messages over
  `max_message_bytes` get the same treatment. The stream is then ended with INVALID_ARGUMENT or
  RESOURCE_EXHAUSTED and the reason counted in `JobTelemetry.count_rejected` (exported as
  trainwarden_telemetry_rejected_total{reason}). The transport limit is set well above
  `max_message_bytes` so that oversized messages reach our check and are counted; messages beyond the
  transport limit are refused by gRPC itself, uncounted.
- Records with bad values inside a well-formed stream (negative durations, unknown stages) are counted as
  "invalid" and skipped; the stream goes on (agent/telemetry/records.py, which turns records into the store's calls).
- The socket's parent directory is created (0770) and the socket is bound 0660 from the moment it exists; a stale
  socket file left by a killed agent is removed (agent/telemetry/socket_file.py).
- Who is streaming is the kernel's answer, not the Hello's: beside the socket, ``<socket>.cred``
  (agent/telemetry/peer_credentials.py) gives each worker a single-use token bound to its SO_PEERCRED pid and
  uid; a Hello with a token gets the verified pid, uid and start time (``WorkerInfo.verified``), one with a bad
  token is refused (INVALID_ARGUMENT), one without a token is refused too (UNAUTHENTICATED) unless the server
  allows unverified streams (``allow_unverified``, the agent's ``--allow-unverified-streams``): those stream,
  marked unverified, and are never signalled.
- One uid cannot take another's rank: a job belongs to the uid of its first verified stream
  (``JobTelemetry.connect``), and a stream of another uid, or an unverified one, is refused (PERMISSION_DENIED)
  for any rank of it, logged with both uids; it replaces nothing. Records are applied only while their stream
  holds its rank (a replaced stream's late records are dropped), and a Commit is answered only for the process
  whose stream holds the rank (the request carries a token of its own).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import threading
import time
from concurrent import futures
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from trainwarden.agent.telemetry.commit_check import UNVERIFIED, CommitGuard, commit_identity, guarded_commit
from trainwarden.agent.telemetry.admission import UNIDENTIFIED, HelloDeadlines, StreamAdmission
from trainwarden.agent.telemetry.peer_credentials import PeerCredentialServer
from trainwarden.agent.telemetry.read_access import ANONYMOUS, ReadAccess
from trainwarden.agent.telemetry.job_telemetry import JobTelemetry
from trainwarden.agent.telemetry.records import apply_record, worker_info
from trainwarden.agent.telemetry.socket_file import (TelemetryServerError, checked_socket_path, prepare_socket_path,
                                                     private_umask)
from trainwarden.agent.telemetry.replies import CheckpointRecordSource, checkpoint_record_reply, job_status
from trainwarden.agent.telemetry.snapshots import WorkerInfo
from trainwarden.agent.shared import telemetry_pb2 as pb
from trainwarden.agent.shared.contract import JOB_NAME_RE, PEER_TOKEN_METADATA, SERVICE_NAME

__all__ = ["DEFAULT_HELLO_TIMEOUT_S", "DEFAULT_MAX_MESSAGE_BYTES", "DEFAULT_MAX_STREAMS_PER_UID", "SERVICE_NAME", "TelemetryServer", "TelemetryServerError"]

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024
DEFAULT_HELLO_TIMEOUT_S = 5.0
DEFAULT_MAX_STREAMS_PER_UID = 64
_RESERVED_THREADS = 16
"""Pool threads beyond ``max_streams``: streams never hold them, so unary calls (health, Status, Commit) and the
refusals of streams past a cap always find one."""
_TRANSPORT_LIMIT_FLOOR = 4 * 1024 * 1024


class _Rejected:
    __slots__ = ("reason", "detail")

    def __init__(self, reason: str, detail: str) -> None:
        self.reason, self.detail = reason, detail


class _End:
    """Ends a stream's response generator; carries the status to abort with, if any."""

    __slots__ = ("code", "detail")

    def __init__(self, code: grpc.StatusCode | None = None, detail: str = "") -> None:
        self.code, self.detail = code, detail


class _StreamHandle:
    __slots__ = ("info", "pid", "commands")

    def __init__(self, info: WorkerInfo, size: int) -> None:
        self.info, self.pid = info, info.pid
        self.commands: queue.Queue = queue.Queue(maxsize=size)


class TelemetryServer:
    """gRPC telemetry server on `unix:<socket_path>` that feeds `job_telemetry`."""

    def __init__(self, socket_path: str | os.PathLike, job_telemetry: JobTelemetry, *,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, max_streams: int = 256,
                 node: str | None = None, command_queue_size: int = 16, allow_unverified: bool = False,
                 hello_timeout_s: float = DEFAULT_HELLO_TIMEOUT_S,
                 max_streams_per_uid: int = DEFAULT_MAX_STREAMS_PER_UID,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``allow_unverified``: accept streams (and Commit requests) without peer credentials, marked unverified
        and never signalled (module docstring); off by default: such a Hello is refused. ``hello_timeout_s``: how
        long a new stream may stay silent; ``max_streams_per_uid``: the streams one uid may hold at once."""
        path = checked_socket_path(socket_path)
        if max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be at least 1024, got {max_message_bytes}")
        if max_streams < 1:
            raise ValueError(f"max_streams must be at least 1, got {max_streams}")
        self.socket_path = path
        self._admission = StreamAdmission(max_streams=max_streams, max_per_uid=max_streams_per_uid)
        self._hello_deadlines = HelloDeadlines(hello_timeout_s, clock=clock,
                                               on_expired=lambda: job_telemetry.count_rejected("no_hello"))
        self._job_telemetry = job_telemetry
        self._reads = ReadAccess(getattr(job_telemetry, "owner_uid", lambda job: None))
        self._max_message_bytes = max_message_bytes
        self._max_streams = max_streams
        self._node = node or socket.gethostname()
        self._command_queue_size = command_queue_size
        self._allow_unverified = allow_unverified
        self._clock = clock
        self._streams: dict[tuple[str, int], _StreamHandle] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._credentials: PeerCredentialServer | None = None
        self._server: grpc.Server | None = None
        self._health: health.HealthServicer | None = None
        self.commit_guard: CommitGuard | None = None
        """Decides the Commit RPC (the launcher of a multi-node job sets it); None allows every commit."""
        self.stream_guard: Callable[[WorkerInfo], str | None] | None = None
        """Why a stream may not speak for its (job, rank) beyond the uid rule, or None (the node agent sets it: a job
        whose launcher it knows takes only that launcher's descendants); None allows every stream."""
        self.checkpoint_record: CheckpointRecordSource | None = None
        """Answers the CheckpointRecord RPC from etcd's ``jobs/<job>/checkpoint`` (the launcher sets it);
        None: unknown."""
        self.memory_steps: Callable[[str, int, int], "list[int]"] | None = None
        """``(job, world_size, rank) -> steps`` of the rank's memory snapshots this agent holds, newest first (the
        launcher that owns the memory sets it: agent/launch/memory_tier.py); None: this agent keeps none."""
        self.memory_held: Callable[[str], "list[tuple[int, int, int]]"] | None = None
        """``job -> [(world_size, rank, step)]``: every memory snapshot file this agent vouches for (set with
        ``memory_steps``)."""

    @property
    def address(self) -> str:
        return f"unix:{self.socket_path}"

    @property
    def health(self) -> health.HealthServicer | None:
        """The standard health service's state while started (SERVING; NOT_SERVING once stopping), for other
        endpoints to answer from (``health_endpoint.HealthEndpoint``); None before the first start."""
        return self._health

    # ---- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        if self._server is not None:
            raise TelemetryServerError("telemetry server already started")
        prepare_socket_path(self.socket_path)
        transport_limit = max(_TRANSPORT_LIMIT_FLOOR, 4 * self._max_message_bytes)
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self._max_streams + _RESERVED_THREADS,
                                       thread_name_prefix="telemetry"),
            maximum_concurrent_rpcs=self._max_streams + 4 * _RESERVED_THREADS,
            options=[("grpc.max_receive_message_length", transport_limit),
                     ("grpc.max_send_message_length", transport_limit)],
        )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Stream": grpc.stream_stream_rpc_method_handler(
                self._stream, request_deserializer=self._deserializer(pb.WorkerMessage),
                response_serializer=pb.AgentCommand.SerializeToString),
            "Status": grpc.unary_unary_rpc_method_handler(
                self._status, request_deserializer=self._deserializer(pb.StatusRequest),
                response_serializer=pb.StatusReply.SerializeToString),
            "Commit": grpc.unary_unary_rpc_method_handler(
                self._commit, request_deserializer=self._deserializer(pb.CommitRequest),
                response_serializer=pb.CommitReply.SerializeToString),
            "CheckpointRecord": grpc.unary_unary_rpc_method_handler(
                self._checkpoint_record, request_deserializer=self._deserializer(pb.CheckpointRecordRequest),
                response_serializer=pb.CheckpointRecordReply.SerializeToString),
        }),))
        self._health = health.HealthServicer()  # a stopped one stays NOT_SERVING: a fresh one per start
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        with private_umask():  # the socket is created 0660: never open to others, not even before a chmod
            if server.add_insecure_port(self.address) == 0:
                raise TelemetryServerError(f"cannot bind {self.address}; is another agent using it?")
            server.start()
        self._credentials = PeerCredentialServer(self.socket_path)
        self._credentials.start()
        self._hello_deadlines.start()
        for service in ("", SERVICE_NAME):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._stopping.clear()
        self._server = server
        log.info("telemetry server listening on %s", self.address, extra={"address": self.address})

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving; open streams end (workers reconnect to the next server on this path)."""
        server, self._server = self._server, None
        if server is None:
            return
        self._health.enter_graceful_shutdown()
        self._stopping.set()
        with self._lock:
            handles = list(self._streams.values())
        for handle in handles:
            _offer(handle.commands, _End())
        server.stop(grace).wait()
        self._hello_deadlines.stop()
        if self._credentials is not None:
            self._credentials.stop()
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass
        log.debug("telemetry server stopped", extra={"address": self.address})

    def send_command(self, job: str, rank: int, command: pb.AgentCommand) -> bool:
        """Queue `command` on the stream of (job, rank); False when that rank is not connected or is
        not reading its commands."""
        with self._lock:
            handle = self._streams.get((job, rank))
        return handle is not None and _offer(handle.commands, command)

    def connected(self) -> list[tuple[str, int]]:
        """(job, rank) of every open stream."""
        with self._lock:
            return sorted(self._streams)

    # ---- RPCs ----------------------------------------------------------------------------------------

    def _deserializer(self, message_type):
        limit = self._max_message_bytes

        def deserialize(data: bytes):
            if len(data) > limit:
                return _Rejected("oversized", f"message of {len(data)} bytes exceeds the {limit}-byte limit")
            try:
                return message_type.FromString(data)
            except Exception as exc:  # protobuf raises DecodeError and friends
                return _Rejected("malformed", f"cannot decode {message_type.__name__}: {exc}")
        return deserialize

    def _reject(self, context, rejected: _Rejected, code: grpc.StatusCode | None = None):
        self._job_telemetry.count_rejected(rejected.reason)
        log.warning("telemetry message rejected: %s", rejected.detail, extra={"reason": rejected.reason})
        if code is None:
            code = (grpc.StatusCode.RESOURCE_EXHAUSTED if rejected.reason == "oversized"
                    else grpc.StatusCode.INVALID_ARGUMENT)
        context.abort(code, rejected.detail)

    def _cred_path(self) -> str:
        return str(self._credentials.path) if self._credentials is not None else f"{self.socket_path}.cred"

    def open_streams(self) -> dict:
        """uid (or "unidentified") -> telemetry streams open now, Hello or not."""
        return self._admission.open_streams()

    def _stream(self, request_iterator, context):
        """Admit the stream under the caps, then serve it (``_serve_stream``); its count ends with it."""
        token = dict(context.invocation_metadata() or ()).get(PEER_TOKEN_METADATA, "")
        cred = None
        if token:
            cred = self._credentials.take(token) if self._credentials else None
            if cred is None:
                self._reject(context, _Rejected("invalid", "unknown, used or expired peer token in the stream's "
                                                "metadata: fetch a new one from the agent's .cred socket per stream"))
        counted = [cred.uid if cred is not None else UNIDENTIFIED]
        refusal = self._admission.admit(counted[0])
        if refusal is not None:
            self._job_telemetry.count_rejected("limit")
            log.warning("telemetry stream refused: %s", refusal, extra={"reason": "limit"})
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        try:
            yield from self._serve_stream(request_iterator, context, token, cred, counted)
        finally:
            self._admission.release(counted[0])

    def _first_message(self, request_iterator, context):
        """The stream's first message, or None when it ended (or sent nothing within the Hello deadline)."""
        self._hello_deadlines.expect(context, context.cancel)
        try:
            return next(request_iterator, None)
        except grpc.RpcError:
            return None
        finally:
            self._hello_deadlines.arrived(context)

    def _serve_stream(self, request_iterator, context, token: str, cred, counted: list):
        first = self._first_message(request_iterator, context)
        if first is None:
            return
        info = self._admit(first, context, token, cred, counted)
        key = (info.job, info.rank)
        handle = self._register(info, context)
        reader = threading.Thread(target=self._read, args=(request_iterator, info, handle),
                                  name=f"telemetry-read-{info.job}-{info.rank}", daemon=True)
        reader.start()
        try:
            while not self._stopping.is_set() and context.is_active():
                try:
                    item = handle.commands.get(timeout=0.5)
                except queue.Empty:
                    continue
                if isinstance(item, _End):
                    if item.code is not None:
                        context.abort(item.code, item.detail)
                    break
                yield item
        finally:
            with self._lock:
                current = self._streams.get(key) is handle
                if current:
                    del self._streams[key]
            if current:  # a stream that a newer one replaced leaves the rank connected
                self._job_telemetry.disconnect(info.job, info.rank, info.pid)
            log.debug("worker stream ended: job %s rank %d pid %d", info.job, info.rank, info.pid,
                      extra={"job": info.job, "rank": info.rank, "pid": info.pid})

    def _admit(self, first, context, token: str, cred, counted: list) -> WorkerInfo:
        """Who the stream's first message says the worker is, with the kernel's word for its pid and uid; aborts
        the call (``_reject``, ``context.abort`` raise) for a missing or bad Hello, an unknown token, a missing one
        where tokens are required, a uid over its stream limit or a worker the guard refuses."""
        if isinstance(first, _Rejected):
            self._reject(context, first)
        if first.WhichOneof("record") != "hello":
            self._reject(context, _Rejected("no_hello", "the first message on a stream must be a Hello"))
        if not JOB_NAME_RE.match(first.hello.job):
            self._reject(context, _Rejected("invalid", f"job name {first.hello.job[:80]!r} breaks the job-name rule "
                                            "(1-63 lowercase letters, digits, '.', '_' or '-'); set TRAINWARDEN_JOB"))
        info = worker_info(first.hello)
        if info is None:
            self._reject(context, _Rejected("invalid", f"invalid Hello: {first.hello}".replace("\n", " ")))
        if first.hello.peer_token:
            if cred is None or first.hello.peer_token != token:  # the metadata's token stands for the Hello's
                cred = self._credentials.take(first.hello.peer_token) if self._credentials else None
            if cred is None:
                self._reject(context, _Rejected("invalid", "unknown, used or expired peer token: fetch a new one "
                                                "from the agent's .cred socket for every stream"))
            # the kernel's pid (the agent's pid namespace), not the claim: a container states its own
            info = dataclasses.replace(info, pid=cred.pid, verified=True, started=cred.started, uid=cred.uid)
            refusal = self._admission.move(counted[0], cred.uid)
            if refusal is not None:
                self._job_telemetry.count_rejected("limit")
                log.warning("telemetry stream refused: %s", refusal, extra={"job": info.job, "rank": info.rank})
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
            counted[0] = cred.uid
        elif cred is not None:
            self._reject(context, _Rejected("invalid", "the Hello carries no peer token but the stream's metadata "
                                            "does: send the same token in both"))
        elif not self._allow_unverified:
            self._reject(context, _Rejected("unverified", UNVERIFIED.format(what="a Hello", path=self._cred_path())),
                         grpc.StatusCode.UNAUTHENTICATED)
        guard = self.stream_guard
        refusal = guard(info) if guard is not None else None
        if refusal is not None:
            log.warning("telemetry stream refused: %s", refusal, extra={"job": info.job, "rank": info.rank})
            self._job_telemetry.count_rejected("identity")
            context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        return info

    def _register(self, info: WorkerInfo, context) -> _StreamHandle:
        """The admitted worker's stream becomes its rank's (one decision per rank: the job's owner check and the
        replacement of an older stream together); aborts the call when the job refuses it."""
        key = (info.job, info.rank)
        handle = _StreamHandle(info, self._command_queue_size)
        with self._lock:  # one decision per (job, rank): the owner check and the replacement together
            refusal = self._job_telemetry.connect(info)
            previous = None
            if refusal is None:
                previous = self._streams.get(key)
                self._streams[key] = handle
        if refusal is not None:
            with self._lock:
                holder = self._streams.get(key)
            held = (f"; the rank's stream: pid {holder.pid} uid {holder.info.uid}" if holder is not None
                    else "; the rank has no stream now")
            log.warning("telemetry stream refused: %s (this stream: pid %d uid %s%s)", refusal, info.pid,
                        info.uid if info.verified else "unverified", held,
                        extra={"job": info.job, "rank": info.rank, "uid": info.uid})
            self._job_telemetry.count_rejected("identity")
            context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        if previous is not None:  # a reconnect or a restarted worker of the job's uid replaces the old stream
            _offer(previous.commands, _End())
        log.debug("worker connected: job %s rank %d pid %d", info.job, info.rank, info.pid,
                  extra={"job": info.job, "rank": info.rank, "pid": info.pid})
        return handle

    def _read(self, request_iterator, info: WorkerInfo, handle: _StreamHandle) -> None:
        end = _End()
        key, streams = (info.job, info.rank), self._streams
        try:
            for message in request_iterator:
                if streams.get(key) is not handle:  # replaced by a newer stream of the rank: it speaks now
                    break
                if isinstance(message, _Rejected):
                    self._job_telemetry.count_rejected(message.reason)
                    log.warning("telemetry message rejected: %s", message.detail,
                                extra={"reason": message.reason, "job": info.job, "rank": info.rank})
                    end = _End(grpc.StatusCode.RESOURCE_EXHAUSTED if message.reason == "oversized"
                               else grpc.StatusCode.INVALID_ARGUMENT, message.detail)
                    break
                try:
                    self._apply(info, message)
                except Exception:  # one bad record must not end the stream or the agent
                    self._job_telemetry.count_rejected("invalid")
                    log.exception("cannot apply telemetry record", extra={"job": info.job, "rank": info.rank})
        except grpc.RpcError:
            pass  # the client went away or the server is stopping
        except Exception:
            log.exception("telemetry reader failed", extra={"job": info.job, "rank": info.rank})
        finally:
            while not _offer(handle.commands, end):  # never lose the end marker behind full commands
                try:
                    handle.commands.get_nowait()
                except queue.Empty:
                    pass

    def _apply(self, info: WorkerInfo, message: pb.WorkerMessage) -> None:
        apply_record(self._job_telemetry, info, message)

    def _status(self, request, context) -> pb.StatusReply:
        if isinstance(request, _Rejected):
            self._reject(context, request)
        uid = self._reader_uid(context)
        now = self._clock()
        reply = pb.StatusReply(node=self._node)
        for job in self._job_telemetry.snapshot(request.job or None):
            if self._reads.may_see(uid, job.job):  # another uid's job is left out as if absent (read_access.py)
                reply.jobs.append(job_status(job, now))
        return reply

    def _reader_uid(self, context) -> int | None:
        """The kernel's uid of a reading caller, from the peer token in its call's metadata; ``ANONYMOUS`` without
        one; an unknown or used token aborts the call."""
        token = dict(context.invocation_metadata() or ()).get(PEER_TOKEN_METADATA, "")
        if not token:
            return ANONYMOUS
        cred = self._credentials.take(token) if self._credentials else None
        if cred is None:
            self._reject(context, _Rejected("invalid", "unknown, used or expired peer token in the call's metadata: "
                                            "fetch a new one from the agent's .cred socket for every call"))
        return cred.uid

    def _commit(self, request, context) -> pb.CommitReply:
        """May this rank publish the checkpoint as the job's latest? Only the process whose stream holds the rank
        may ask (``commit_identity``: the request's own peer token); the guard then gets the pid the kernel
        vouched for on the rank's stream (0 when the rank has no stream), never a pid the request claims."""
        if isinstance(request, _Rejected):
            self._reject(context, request)
        with self._lock:
            handle = self._streams.get((request.job, request.rank))
        take = self._credentials.take if self._credentials else (lambda token: None)
        refusal = commit_identity(request, handle.info if handle is not None else None, take,
                                  allow_unverified=self._allow_unverified, cred_path=self._cred_path())
        if refusal is not None:
            self._job_telemetry.count_rejected("unverified" if refusal.startswith("no peer token") else "identity")
            log.warning("commit of job %s rank %d step %d refused: %s", request.job, request.rank, request.step,
                        refusal, extra={"job": request.job, "rank": request.rank})
            return pb.CommitReply(allowed=False, reason=refusal)
        return guarded_commit(self.commit_guard, request, handle.pid if handle is not None else 0)

    def _checkpoint_record(self, request, context) -> pb.CheckpointRecordReply:
        """What etcd's record says the job committed (a restore's evidence before any fresh start), and the
        memory snapshots of the asking rank."""
        if isinstance(request, _Rejected):
            self._reject(context, request)
        if not self._reads.may_see(self._reader_uid(context), request.job):
            return pb.CheckpointRecordReply(known=False, source=f"job {request.job} streams as another uid than the "
                                                                "asking process's: its records are its own")
        reply = checkpoint_record_reply(self.checkpoint_record, request.job)
        if self.memory_steps is not None and request.world_size > 0:
            try:
                reply.memory_steps.extend(self.memory_steps(request.job, request.world_size, request.rank))
                if request.all_memory and self.memory_held is not None:
                    reply.memory_held.extend(pb.MemoryFile(world_size=w, rank=r, step=s)
                                             for w, r, s in self.memory_held(request.job))
            except Exception:  # a restore then reads the disk
                log.exception("cannot tell the memory snapshots of job %s", request.job)
        return reply


def _offer(q: queue.Queue, item) -> bool:
    try:
        q.put_nowait(item)
        return True
    except queue.Full:
        return False

"""The worker's telemetry client: a bounded queue, a background sender and reconnects with backoff.

The training thread only calls `record()`: one `deque.append` of a small tuple into a deque with a
`maxlen`, so a full queue drops its oldest record (counted in `dropped`) instead of growing or blocking.
Nothing on that path takes a lock, does I/O or raises.

A daemon thread owns the connection. It opens one bidirectional gRPC stream to the agent's unix socket and
reads the agent's commands from it (handing each to `on_command`); gRPC pulls our request generator from
its own thread, and that generator does the work: every `flush_interval_s` it drains the deque, turns
records into protobuf messages (the steps of one drain go in one message) and feeds step boundaries to
the collective reducer; at the instants a `ReadSchedule` picks (every `fr_interval_s` at most, sooner when
the ring would wrap before, never so often that reads take more than `fr_max_duty` of the time, on a
wall-clock grid the node's ranks share) it reads new Flight Recorder entries and sends cumulative
collective totals and the training thread's arrivals (an empty Collectives record when the recorder is
unavailable: the agent advances compute time on it). The agent may lengthen that longest period while its
detectors need nothing soon (a `ReadPace` command, handled here and not passed to the training loop); every
new stream starts at `fr_interval_s` again. A read costs time in proportion to the ring's size,
not to the new entries (torch 2.13: ~6-12 us an entry on a 2-core VM, most of it with the GIL held). The same
command may let the sender hold back steps that keep ending (`SendPace`, runtime/send_pace.py): while they do
and its last batch promised the next, a flush sends nothing; each batch says when the next comes.

When the agent is absent, slow or restarting, the stream fails or stalls; records keep queueing (and the
oldest drop), and the thread reconnects with exponential backoff capped at `backoff_max_s`, on one
channel for the client's life; while the socket file does not exist it only polls for it (each call
attempt costs a gRPC thread). Every new stream starts with the same Hello, so an agent that restarted
learns who we are again. `close()` ends the stream after a final collectives record and a Goodbye.
The sender thread waits for commands without gRPC's 0.1 s polling (runtime/grpc_wait.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import grpc

from trainwarden.agent.shared import contract
from trainwarden.agent.shared import telemetry_pb2 as pb
from trainwarden.agent.shared.contract import EXIT_ABORTED

from .agent_requests import fetch_peer_token
from .flight_recorder import ArrivalLog, CollectiveReducer, FlightRecorder, ReadSchedule, ring_capacity
from .grpc_wait import wait_patiently_on_this_thread
from .send_pace import SendPace
from .thread_watch import STILL_REFRESH_S, STILL_REPORT_AFTER_S, ThreadWatch  # noqa: F401 (re-exported)

__all__ = ["CHECKPOINT_STAGES", "EXIT_ABORTED", "ClientConfig", "TelemetryClient"]

log = logging.getLogger(__name__)

CHECKPOINT_STAGES = {name: pb.CheckpointStage.Value(name.upper()) for name in contract.CHECKPOINT_STAGES}
"""Stage name -> its protocol enum value."""
STEP_RECORD = "step"
"""Tag of a queued step: (STEP_RECORD, index, start wall ns, duration ns, tokens, phases)."""
HELLO_RECORD = "hello"
"""Tag of a queued Hello update: (HELLO_RECORD,); the sender sends the client's current Hello."""
CHECKPOINT_RECORD = "checkpoint"
"""Tag of a queued checkpoint event: (CHECKPOINT_RECORD, stage enum, step, seconds, bytes, path, detail)."""
NUMERIC_RECORD = "numeric"
"""Tag of a queued numeric event: (NUMERIC_RECORD, kind, step, first rank, action, detail)."""
_ESTABLISHED_AFTER_S = 1.0
_STEPS_PER_MESSAGE = 256  # ~30 bytes a step: far below the agent's message size limit
_MAX_PACE_S = 30.0  # the longest read period an agent may ask for (the ring's coverage bounds it anyway)


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """How the telemetry client queues, sends and reconnects."""

    socket_path: str
    """The agent's unix socket (TRAINWARDEN_AGENT_SOCKET)."""
    queue_size: int = 4096
    """Records kept while the agent is away; the oldest are dropped beyond this."""
    flush_interval_s: float = contract.FLUSH_INTERVAL_S
    """How often the sender drains the queue. Every message costs the worker Python time (gRPC's stack, with
    the GIL). The hang deadline needs it this short: the agent times a hang from the step's own end, but sees
    the end only when its batch arrives, so a healthy job can look stalled for up to this period plus a step,
    and the deadline's floor (1.5 s) must stay well above that. It was 1.5 s with a 5 s floor; what the shorter
    period costs a step is in BENCHMARKS.md (Telemetry). Checkpoint events are sent at once."""
    fr_interval_s: float = contract.FR_READ_INTERVAL_S
    """Longest period between Flight Recorder reads (how late arrivals may reach the agent) until the agent
    asks for another (a `ReadPace` command: it asks for a longer one while none of its detectors is near a
    decision on the job, and for this one again when one is). 2 s here would save a quarter of the reads of
    a job whose ring is not the bound, but a 1.3x straggler in a DDP job with 0.2 s steps was then flagged
    about 5 steps later (BENCHMARKS.md, issue 14), so it stays 1.5 s."""
    fr_min_interval_s: float = 0.5
    """Shortest period between reads, however fast the ring fills."""
    fr_max_duty: float = 0.005
    """Longest share of the time spent reading the Flight Recorder: a read costs CPU (with the GIL held)
    in proportion to the ring's size, not to the new entries, so costly reads (the median of the last 5)
    lengthen the period; collectives that overrun the ring in between are then sampled."""
    backoff_initial_s: float = 0.05
    """First reconnect delay."""
    backoff_max_s: float = 2.0
    """Reconnect delay cap."""

    def __post_init__(self) -> None:
        if not self.socket_path:
            raise ValueError("socket_path must name the agent's unix socket")
        if self.queue_size < 16:
            raise ValueError(f"queue_size must be at least 16, got {self.queue_size}")
        for name in ("flush_interval_s", "fr_interval_s", "fr_min_interval_s", "fr_max_duty", "backoff_initial_s",
                     "backoff_max_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class TelemetryClient:
    """Streams queued records to the agent from a daemon thread; see the module docstring."""

    def __init__(self, config: ClientConfig, hello: pb.Hello, *,
                 on_command: Callable[[pb.AgentCommand], None],
                 flight_recorder: FlightRecorder | None = None, training_thread: int | None = None) -> None:
        self.config = config
        self._hello = hello
        self._on_command = on_command
        self._fr = flight_recorder
        self._reducer = CollectiveReducer()
        # collectives enqueued by the thread that runs the steps (the one constructing the client)
        self._training_thread = threading.get_ident() if training_thread is None else training_thread
        self._arrivals = ArrivalLog(self._training_thread)
        self._thread_watch = ThreadWatch(self._training_thread, flight_recorder)
        self._queue: deque = deque(maxlen=config.queue_size)
        self._maxlen = config.queue_size
        self.dropped = 0
        self.reconnects = 0
        self.sent = 0
        self._reported_dropped = 0
        self._schedule = ReadSchedule(interval_s=config.fr_interval_s, min_interval_s=config.fr_min_interval_s,
                                      max_duty=config.fr_max_duty, capacity=ring_capacity())
        self._next_fr_read = self._schedule.next_read(time.time())  # wall clock: the grid the ranks share
        self.drains = 0  # times the sender woke and drained (a flush, a read, a record_soon)
        # the read period the agent asked for on this stream, and the one applied (a new stream starts with
        # the default: the agent tells each stream what it wants, a restarted agent included)
        self._pace_asked = self._pace_applied = config.fr_interval_s
        self._send_pace = SendPace(config.flush_interval_s, _step_end)  # the agent may ask for fewer sends
        self._fr_seen = 0  # entries returned or missed so far: their growth is the ring's fill rate
        self.fr_reads = 0
        self.fr_read_cpu_s = 0.0
        self._reported_missed = 0
        self._closing = threading.Event()
        self._goodbye = "closed"
        self._wake = threading.Event()
        self._call = None
        self._refused_said = False  # the agent's refusal of this worker (peer credentials) is logged once
        self._thread = threading.Thread(target=self._run, name="trainwarden-telemetry", daemon=True)

    # ---- training thread -----------------------------------------------------------------------------

    @property
    def still_reads(self) -> int:
        """Flight Recorder dumps the still-thread check took (``ThreadWatch``)."""
        return self._thread_watch.reads

    @property
    def still_read_cpu_s(self) -> float:
        return self._thread_watch.read_cpu_s

    @property
    def held(self) -> int:
        """Wake-ups that held the queued steps back (runtime/send_pace.py)."""
        return self._send_pace.held

    def record(self, item: tuple) -> None:
        """Queue one record (hot path: no lock, no I/O, never raises)."""
        q = self._queue
        if len(q) >= self._maxlen:
            self.dropped += 1
        q.append(item)

    def record_soon(self, item: tuple) -> None:
        """Queue one record and wake the sender (not for every step: waking it takes a lock)."""
        self.record(item)
        self._wake.set()

    def update_hello(self, *, mesh=None, step_source: str | None = None, gpu_uuid: str | None = None) -> None:
        """Change what this worker says about itself (its mesh, where its steps come from, its GPU): sent now
        on the open stream as a second Hello, and at the start of every later one."""
        hello = pb.Hello()
        hello.CopyFrom(self._hello)
        if mesh is not None:
            hello.mesh.clear()
            hello.mesh.update({str(k): int(v) for k, v in dict(mesh).items()})
        if step_source is not None:
            hello.step_source = step_source
        if gpu_uuid is not None:
            hello.gpu_uuid = gpu_uuid
        self._hello = hello  # one reference swap: the sender copies whichever it sees
        self.record_soon((HELLO_RECORD,))

    # ---- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the queue to be handed to gRPC; True when it was."""
        deadline = time.monotonic() + timeout
        self._wake.set()
        while self._queue and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue

    def close(self, timeout: float = 2.0, reason: str = "closed") -> None:
        """Send what is queued, final collective totals and a Goodbye, end the stream and stop the thread
        (best effort within `timeout`: an absent or stuck agent gets nothing)."""
        if self._closing.is_set():
            return
        self._goodbye = reason
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout)
        call = self._call
        if self._thread.is_alive() and call is not None:
            call.cancel()
            self._thread.join(0.5)

    # ---- sender thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        cfg = self.config
        wait_patiently_on_this_thread()  # runtime/grpc_wait.py: no 0.1 s wake-ups while waiting for commands
        # one channel for the client's life: gRPC reconnects it (to a restarted agent, too) with the same
        # backoff bounds, and a failed call on a disconnected channel costs almost nothing
        channel = grpc.insecure_channel(f"unix:{cfg.socket_path}", options=[
            ("grpc.enable_retries", 0),
            ("grpc.initial_reconnect_backoff_ms", int(cfg.backoff_initial_s * 1000)),
            ("grpc.min_reconnect_backoff_ms", int(cfg.backoff_initial_s * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(cfg.backoff_max_s * 1000)),
        ])
        stream = channel.stream_stream(contract.STREAM_METHOD, request_serializer=pb.WorkerMessage.SerializeToString,
                                       response_deserializer=pb.AgentCommand.FromString)
        backoff = cfg.backoff_initial_s
        try:
            while not self._closing.is_set():
                if not os.path.exists(cfg.socket_path):  # no agent: skip the (costly) call attempt
                    self._closing.wait(backoff)
                    backoff = min(cfg.backoff_max_s, backoff * 2)
                    continue
                started = time.monotonic()
                stream_done = threading.Event()
                denied = False
                try:
                    token = fetch_peer_token(cfg.socket_path)  # "" if the agent has none for us
                    # in the metadata too: the agent knows the stream's uid before any message (its per-uid cap)
                    self._call = stream(self._requests(stream_done, token), wait_for_ready=False,
                                        metadata=((contract.PEER_TOKEN_METADATA, token),) if token else None)
                    for command in self._call:
                        self._handle(command)
                except grpc.RpcError as exc:
                    code = exc.code() if hasattr(exc, "code") else None
                    denied = code == grpc.StatusCode.PERMISSION_DENIED  # durable: the job is another uid's
                    if code in _REFUSED and not self._refused_said and not self._closing.is_set():
                        self._refused_said = True  # the agent says who this process is not: say it, once
                        log.warning("trainwarden: the node agent refuses this worker's telemetry (%s: %s); training "
                                    "goes on without it, and the worker asks again", code.name, exc.details())
                    elif not self._closing.is_set():
                        log.debug("telemetry stream ended: %s", code if code is not None else exc)
                except Exception:  # survive one bad iteration; never kill the worker
                    log.exception("telemetry stream failed")
                finally:
                    self._call = None
                    stream_done.set()
                if self._closing.is_set():
                    break
                if time.monotonic() - started > _ESTABLISHED_AFTER_S:
                    backoff = cfg.backoff_initial_s
                self.reconnects += 1
                self._closing.wait(_DENIED_RETRY_S if denied else backoff)
                backoff = min(cfg.backoff_max_s, backoff * 2)
        finally:
            channel.close()

    def _handle(self, command: pb.AgentCommand) -> None:
        if command.WhichOneof("command") == "read_pace":  # the client's own business: applied by the drain
            seconds = command.read_pace.max_period_seconds
            self._pace_asked = min(_MAX_PACE_S, seconds) if seconds > 0 else self.config.fr_interval_s
            self._send_pace.ask(command.read_pace.step_send_seconds)
            self._wake.set()
            return
        try:
            self._on_command(command)
        except Exception:
            log.exception("handling agent command %s failed", command.WhichOneof("command"))

    def _requests(self, stream_done: threading.Event, token: str) -> Iterator[pb.WorkerMessage]:
        hello = pb.Hello()
        hello.CopyFrom(self._hello)
        hello.peer_token = token
        self._pace_asked = self.config.fr_interval_s
        self._send_pace.new_stream()
        self._thread_watch.new_stream()  # a new stream (perhaps a restarted agent) hears where the thread is
        yield pb.WorkerMessage(hello=hello)
        pace = self._send_pace
        while not stream_done.is_set():
            closing = woken = self._closing.is_set()
            if not closing:  # wake for the next flush, or on the read grid if that comes first
                woken = self._wake.wait(max(0.0, min(self.config.flush_interval_s, self._next_fr_read - time.time())))
                self._wake.clear()
                if stream_done.is_set():  # the call failed while we waited: keep the records queued
                    return
            wall, now = time.time(), time.monotonic()
            pace.look(self._queue, wall)
            if not woken and wall < self._next_fr_read and pace.may_hold(now, len(self._queue)):
                continue  # steps keep ending and the agent was promised the next batch later (send_pace.py)
            within, withdraw = pace.sending(now, final=closing)
            try:
                messages = self._drain(final=closing, promise_s=within, withdraw=withdraw)
            except Exception:
                log.exception("cannot build telemetry messages")
                messages = []
            for message in messages:
                self.sent += 1
                yield message
            if closing:  # ending the request stream ends the call once the agent has read it all
                yield pb.WorkerMessage(goodbye=pb.Goodbye(reason=self._goodbye))
                return

    def _drain(self, final: bool = False, promise_s: float = 0.0, withdraw: bool = False) -> list[pb.WorkerMessage]:
        """The queue's records as messages, with Flight Recorder totals when a read is due; their Steps promise the
        next batch within `promise_s` (0: nothing), and with `withdraw` a Steps goes even if empty."""
        self.drains += 1
        messages: list[pb.WorkerMessage] = []
        steps = pb.Steps()
        q = self._queue
        stepped = False  # a step ended since the last drain: the training thread is not still
        while q:
            try:
                item = q.popleft()
            except IndexError:
                break
            kind = item[0]
            if kind == STEP_RECORD:
                stepped = True
                _, index, start_wall_ns, duration_ns, tokens, phases = item
                self._reducer.add_step(start_wall_ns, start_wall_ns + duration_ns)
                if phases:
                    steps.steps.add(index=index, start_unix=start_wall_ns / 1e9, duration_seconds=duration_ns / 1e9,
                                    tokens=tokens, phases=phases)
                else:  # no empty map: filling one goes through Python's MutableMapping (half the build)
                    steps.steps.add(index=index, start_unix=start_wall_ns / 1e9, duration_seconds=duration_ns / 1e9,
                                    tokens=tokens)
                if len(steps.steps) >= _STEPS_PER_MESSAGE:
                    messages.append(pb.WorkerMessage(steps=steps))
                    steps = pb.Steps()
            elif kind == HELLO_RECORD:
                if steps.steps:
                    messages.append(pb.WorkerMessage(steps=steps))
                    steps = pb.Steps()
                hello = pb.Hello()
                hello.CopyFrom(self._hello)
                messages.append(pb.WorkerMessage(hello=hello))
            elif kind == CHECKPOINT_RECORD:
                _, stage, step, seconds, nbytes, path, detail = item
                if steps.steps:  # keep the order of steps and checkpoint events
                    messages.append(pb.WorkerMessage(steps=steps))
                    steps = pb.Steps()
                messages.append(pb.WorkerMessage(checkpoint=pb.Checkpoint(
                    stage=stage, step=step, seconds=seconds, bytes=nbytes, path=path, detail=detail)))
            elif kind == NUMERIC_RECORD:
                _, what, step, first_rank, action, detail = item
                if steps.steps:
                    messages.append(pb.WorkerMessage(steps=steps))
                    steps = pb.Steps()
                messages.append(pb.WorkerMessage(numeric=pb.Numeric(
                    kind=what, step=step, first_rank=first_rank, action=action, detail=detail)))
        if steps.steps or withdraw or promise_s > 0:
            messages.append(pb.WorkerMessage(steps=steps))  # even empty: it renews or withdraws the promise
        if promise_s > 0:
            for message in messages:
                if message.WhichOneof("record") == "steps":
                    message.steps.next_within_seconds = promise_s
        still = self._thread_watch.check(stepped)
        if still is not None:
            messages.append(still)
        now = time.time()
        pace = self._pace_asked
        if pace != self._pace_applied:  # on the new period's grid, unless a read is planned sooner
            self._pace_applied = pace
            self._next_fr_read = min(self._next_fr_read, self._schedule.set_interval(pace, now))
        # (a wall clock stepped back by more than a period would otherwise put the next read far away)
        if final or now >= self._next_fr_read or self._next_fr_read - now > 2 * self._schedule.period_s:
            cpu = time.thread_time()
            messages.append(self._collectives())
            # the duty budget is CPU this thread spends reading (with the GIL held: the training thread's
            # time too), and it follows the median of recent reads: one slow read (start-up, a checkpoint's
            # burst) must not push the next one so far away that the ring wraps and the agent goes blind
            cost = time.thread_time() - cpu
            self.fr_reads += 1
            self.fr_read_cpu_s += cost
            seen = self._fr.missed + self._fr.returned if self._fr is not None else 0
            self._next_fr_read = self._schedule.next_read(now, cost_s=cost, entries=seen - self._fr_seen)
            self._fr_seen = seen
        if self.dropped != self._reported_dropped:
            self._reported_dropped = self.dropped
            messages.append(pb.WorkerMessage(stats=pb.ClientStats(dropped=self.dropped,
                                                                  reconnects=self.reconnects)))
        return messages

    def _collectives(self) -> pb.WorkerMessage:
        fr = self._fr
        arrivals = pb.Arrivals()
        if fr is not None and fr.available:
            try:
                entries = fr.read_new()
                self._reducer.add_entries(entries)
                batch = self._arrivals.add(entries, complete_below=fr.complete_below, missed=fr.missed)
                arrivals = _arrivals_message(batch)
            except Exception as exc:  # keep sending steps when the recorder misbehaves
                log.warning("flight recorder read failed: %s", exc)
            if fr.missed > self._reported_missed:
                # once per process: a job this fast is sampled on purpose, every read would say it again
                (log.warning if self._reported_missed == 0 else log.debug)(
                    "%d flight recorder entries were overwritten before they were read: this rank enqueues "
                    "more collectives in %.2g s than the ring holds, and reading it more often would cost more "
                    "than %.2g%% of the time, so collectives are sampled (each read sees the ring's last "
                    "entries; collective wait is measured on those). TRAINWARDEN_FR_MAX_DUTY or "
                    "TORCH_FR_BUFFER_SIZE trade cost for coverage", fr.missed - self._reported_missed,
                    self._schedule.period_s, self.config.fr_max_duty * 100)
                self._reported_missed = fr.missed
        ops = [pb.CollectiveSummary(process_group=s.process_group, op=s.op, count=s.count,
                                    wait_seconds=s.wait_seconds, last_seq_id=s.last_seq_id)
               for s in self._reducer.summaries()]
        return pb.WorkerMessage(collectives=pb.Collectives(
            ops=ops, has_durations=self._reducer.has_durations, entries_missed=fr.missed if fr else 0,
            arrivals=arrivals))


def _step_end(record: tuple) -> float | None:
    """Wall time a queued step record ended; None for another kind of record."""
    return (record[2] + record[3]) / 1e9 if record[0] == STEP_RECORD else None


_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
"""How the agent refuses a stream for who the kernel says its process is (agent/telemetry/server.py)."""
_DENIED_RETRY_S = 30.0
"""Seconds before asking again after PERMISSION_DENIED (the job belongs to another uid until the agent forgets it),
not the reconnect backoff: neither side spends a log line and a token every 2 s on it."""


def _arrivals_message(batch) -> pb.Arrivals:
    index: dict[str, int] = {}
    ops: dict[str, int] = {}
    group = [index.setdefault(a[0], len(index)) for a in batch.arrivals]
    op = [ops.setdefault(a[3], len(ops)) for a in batch.arrivals]
    return pb.Arrivals(groups=list(index), group=group, seq=[a[1] for a in batch.arrivals],
                       enqueued_ns=[a[2] for a in batch.arrivals], continues=batch.continues,
                       ops=list(ops), op=op,
                       members=[pb.GroupMembers(name=n, ranks=r) for n, r in sorted(batch.members.items())])

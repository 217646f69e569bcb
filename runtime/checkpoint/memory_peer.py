"""A copy of each rank's newest memory snapshot on one other node: ``PeerCopy``.

A node that is lost takes its agent's memory with it. So each rank also sends its newest finished snapshot file
to the same local rank on the next node (rank ``r`` to ``(r + ranks_per_node) % world``), which writes it into
its own node's memory directory (``world-N/peer/``, agent/shared/snapshot_layout.py) and reports it; that node's
agent vouches for it as for its own ranks' files. After a node loss the survivors then hold every old rank's file
of a recent step between them, and the restore reads them through DCP into the smaller world
(runtime/checkpoint/memory_reshard.py) instead of the disk.

The transport is the job's own: a gloo group of its own (``trainwarden-peer-copy``, so its traffic never
interleaves with the Checkpointer's collectives and the Flight Recorder's readers leave it out), point to point,
on two threads per rank: a sender and a receiver. No new listening socket, nothing between agents, nothing that
runs as anyone but the job's user.

The step never waits for it. The writer thread hands each finished file over (``offer``); the sender keeps only
the newest not yet sent and pins it (a pinned file is not reused: a snapshot that would take it is skipped and
counted, ``MemorySnapshots.skipped``), sends it from its mapping without a copy, and unpins it. The receiver
writes each copy into a file of its own under a partial name, checks it (magic, step, rank, world size) and
renames it; it keeps a source's two newest copies (``KEEP``). A failed send or receive (a peer gone) stops this
rank's copying with one warning: the job is restarting by then anyway.

No thread may be blocked in a gloo wait when the process ends (torch 2.13 aborts the process then: SIGABRT at
exit). So the receiver never waits for a header: it posts the receive into a tensor filled with a value no header
has and looks at it every 0.1 s until a header whose check agrees is there (a posted receive nobody waits for is
harmless at exit); only the payload that follows a header is waited for. ``Checkpointer.close`` (every rank)
sends what is pending, then passes a barrier on the Checkpointer's gloo group, so no send is in flight when the
receivers stop; a script that never closes its Checkpointer gets the same minus the barrier at exit (``atexit``).

Memory: each node holds its own ranks' files (two each) and two copies of each rank of the node before it.
"""

from __future__ import annotations

import atexit
import datetime as dt
import logging
import mmap
import os
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from trainwarden.agent.shared.snapshot_layout import KEEP, peer_path, peer_snapshots
from trainwarden.runtime.flight_recorder import INTERNAL_GROUP_PREFIX
from trainwarden.runtime.checkpoint.memory_snapshot import MappedSnapshot, MemorySnapshots

__all__ = ["GROUP_DESC", "PeerCopy"]

log = logging.getLogger(__name__)

GROUP_DESC = INTERNAL_GROUP_PREFIX + "peer-copy"
_DATA = 1
_TIMEOUT = dt.timedelta(days=7)  # the group's: a payload or a send may wait out a hold of the job, never a gloo timeout
_POLL_S = 0.1  # how often the receiver looks for a header (a header waits at most this long)


def _check(values) -> int:
    kind, step, size, world = (int(v) for v in values)
    return (kind * 1_000_003 + step * 10_007 + size * 101 + world * 7 + 0x5EED) & 0x7FFFFFFFFFFF


def _header(kind: int, step: int, size: int, world: int) -> torch.Tensor:
    return torch.tensor([kind, step, size, world, _check((kind, step, size, world))], dtype=torch.int64)


def _blank_header() -> torch.Tensor:
    return torch.full((5,), -1, dtype=torch.int64)  # the check of four -1s is not -1


class PeerCopy:
    """This rank's sender and receiver (see the module's docstring). Made by every rank of the job together
    (``dist.new_group`` is collective)."""

    def __init__(self, memory: MemorySnapshots, *, rank: int, world_size: int, ranks_per_node: int,
                 report: Callable[[int, str, float], None] | None = None) -> None:
        self.memory, self.rank, self.world_size = memory, rank, world_size
        self.dest = (rank + ranks_per_node) % world_size
        self.source = (rank - ranks_per_node) % world_size
        self._report = report  # (step, path, seconds) of each copy received
        self._group = dist.new_group(backend="gloo", timeout=_TIMEOUT, group_desc=GROUP_DESC)
        self._cond = threading.Condition()
        self._pending = None  # (step, file) newest finished and not yet sent
        self._closing = False
        self._drain = False
        self._stopping = threading.Event()
        self.broken = ""
        self.sent = self.received = 0
        self.last_sent_step: int | None = None
        self.last_received_step: int | None = None
        memory.on_written = self.offer
        for leftover in (peer_path(memory.directory, world_size, self.source, 0).parent).glob(
                f"rank-{self.source:05d}.step-*.pt.tmp"):
            leftover.unlink(missing_ok=True)  # a receiver of this rank that died while receiving
        self._sender = threading.Thread(target=self._send_loop, name="trainwarden-peer-send", daemon=True)
        self._receiver = threading.Thread(target=self._receive_loop, name="trainwarden-peer-receive", daemon=True)
        self._sender.start()
        self._receiver.start()
        atexit.register(self.close)  # a script that never closes its Checkpointer: no send left in flight

    # -- the writer thread's hand-over ---------------------------------------------------------------------

    def offer(self, step: int, file) -> None:
        """A finished snapshot file: the newest to send (an older one not yet sent is let go)."""
        with self._cond:
            if self.broken or self._closing:
                return
            if self._pending is not None:
                self._pending[1].pinned = False
            file.pinned = True
            self._pending = (step, file)
            self._cond.notify_all()

    # -- sender ------------------------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closing:
                    self._cond.wait()
                if self._closing and (self._pending is None or not self._drain):
                    if self._pending is not None:  # at exit: let go, no restart of this run will read it
                        self._pending[1].pinned = False
                        self._pending = None
                    return
                step, file = self._pending
                self._pending = None
            try:
                self._send(step, file)
            except Exception as exc:  # a peer gone: the job restarts; the step must not notice
                self._fail(f"sending the snapshot of step {step} to rank {self.dest} failed ({type(exc).__name__}: "
                           f"{exc})")
                return
            finally:
                file.pinned = False

    def _send(self, step: int, file) -> None:
        with open(file.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        payload = torch.frombuffer(mapped, dtype=torch.uint8)
        dist.send(_header(_DATA, step, size, self.world_size), group=self._group, group_dst=self.dest)
        dist.send(payload, group=self._group, group_dst=self.dest)
        del payload
        self.sent += 1
        self.last_sent_step = step

    # -- receiver ----------------------------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        """Wait for the source's header without a thread blocked in gloo: a receive is posted into a tensor filled
        with a value no header has, and the thread looks at the tensor every ``_POLL_S`` until a whole header (its
        check agrees) is there. A thread blocked in a gloo wait when the process ends aborts it; a posted receive
        that nobody waits for does not."""
        header = _blank_header()
        posted = dist.irecv(header, group=self._group, group_src=self.source)
        while not self._stopping.wait(_POLL_S):
            values = header.tolist()
            if values[4] != _check(values[:4]):
                continue
            try:
                posted.wait()  # already complete: this retires it
                _, step, size, world = values[:4]
                self._receive(step, size, world)  # its payload follows at once
                header = _blank_header()
                posted = dist.irecv(header, group=self._group, group_src=self.source)
            except Exception as exc:
                self._fail(f"receiving rank {self.source}'s snapshot failed ({type(exc).__name__}: {exc})")
                return

    def _receive(self, step: int, size: int, world: int) -> None:
        began = time.monotonic()
        final = peer_path(self.memory.directory, world, self.source, step)
        partial = final.with_name(final.name + ".tmp")
        final.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        try:
            dist.recv(torch.frombuffer(mapped, dtype=torch.uint8), group=self._group, group_src=self.source)
            mapped.flush()
        finally:
            mapped.close()
        try:
            copy = MappedSnapshot(partial)
            body = copy.header["body"]
            copy.close()
            if (body.get("step"), body.get("rank"), body.get("world_size")) != (step, self.source, world):
                raise ValueError(f"holds step {body.get('step')} of rank {body.get('rank')} at world size "
                                 f"{body.get('world_size')}")
        except Exception as exc:
            partial.unlink(missing_ok=True)
            log.warning("rank %d's copy of step %d from rank %d is not a whole snapshot (%s): not kept", self.rank,
                        step, self.source, exc)
            return
        os.replace(partial, final)
        for _, older in peer_snapshots(self.memory.directory, world, self.source)[KEEP:]:
            older.unlink(missing_ok=True)
        self.received += 1
        self.last_received_step = step
        if self._report is not None:
            try:
                self._report(step, str(final), time.monotonic() - began)
            except Exception:
                log.debug("could not report the copy of step %d", step, exc_info=True)

    # -- both --------------------------------------------------------------------------------------------------

    def _fail(self, why: str) -> None:
        with self._cond:
            first = not self.broken
            self.broken = why
            if self._pending is not None:
                self._pending[1].pinned = False
                self._pending = None
        if first and not self._closing:  # a peer gone: the job is restarting, and copies resume with it
            log.warning("rank %d: %s; the copies of memory snapshots between this node and the next stop until the "
                        "workers restart", self.rank, why, extra={"event": "peer_copy_off"})

    def close(self, barrier: Callable[[], None] | None = None, timeout: float = 10.0) -> None:
        """Stop copying: send what is pending, then ``barrier`` (every rank has, so no send is left that a receiver
        would have to take), then stop the receiver. Without a barrier (at process exit) what is pending is let go
        and a send in flight is given ``timeout`` seconds."""
        with self._cond:
            if self._stopping.is_set():
                return
            self._drain = barrier is not None  # the receivers wait for the barrier: what is pending can go
            self._closing = True
            self._cond.notify_all()
        self._sender.join(timeout)
        if barrier is not None and not self.broken:
            try:
                barrier()
            except Exception as exc:
                log.debug("no barrier at the end of the peer copy: %s", exc)
        self._stopping.set()
        self._receiver.join(timeout)
        if self.memory.on_written == self.offer:
            self.memory.on_written = None
        atexit.unregister(self.close)

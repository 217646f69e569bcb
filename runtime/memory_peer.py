"""A copy of each rank's newest memory snapshot on one other node: ``PeerCopy``.

A node that is lost takes its agent's memory with it. So each rank also sends its newest finished snapshot file
to the same local rank on the next node (rank ``r`` to ``(r + ranks_per_node) % world``), which writes it into
its own node's memory directory (``world-N/peer/``, agent/proto/snapshot_layout.py) and reports it; that node's
agent vouches for it as for its own ranks' files. After a node loss the survivors then hold every old rank's file
of a recent step between them, and the restore reads them through DCP into the smaller world
(runtime/memory_reshard.py) instead of the disk.

The transport is the job's own: a gloo group of its own (``trainwarden-peer-copy``, so its traffic never
interleaves with the Checkpointer's collectives and the Flight Recorder's readers leave it out), point to point,
on two threads per rank: a sender and a receiver. No new listening socket, nothing between agents, nothing that
runs as anyone but the job's user.

The step never waits for it. The writer thread hands each finished file over (``offer``); the sender keeps only
the newest not yet sent and pins it (a pinned file is not reused: a snapshot that would take it is skipped and
counted, ``MemorySnapshots.skipped``), sends it from its mapping without a copy, and unpins it. The receiver
writes each copy into a file of its own under a partial name, checks it (magic, step, rank, world size) and
renames it; it keeps a source's two newest copies (``KEEP``). A failed send or receive (a peer gone) stops this
rank's copying with one warning: the job is restarting by then anyway. ``close`` sends what is pending, then an
end message, so the peer's receiver returns; a rank that dies leaves its peer's receiver blocked in a daemon
thread until that process ends too (the restart ends it).

Memory: each node holds its own ranks' files (two each) and two copies of each rank of the node before it.
"""

from __future__ import annotations

import datetime as dt
import logging
import mmap
import os
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from trainwarden.agent.proto.snapshot_layout import KEEP, peer_path, peer_snapshots
from trainwarden.runtime.flight_recorder import INTERNAL_GROUP_PREFIX
from trainwarden.runtime.memory_snapshot import MappedSnapshot, MemorySnapshots

__all__ = ["GROUP_DESC", "PeerCopy"]

log = logging.getLogger(__name__)

GROUP_DESC = INTERNAL_GROUP_PREFIX + "peer-copy"
_DATA, _END = 1, 0
_TIMEOUT = dt.timedelta(days=7)  # a receive waits for the next snapshot, however long the steps or a hold last


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
        self._sending = False
        self._closing = False
        self.broken = ""
        self.sent = self.received = 0
        self.last_sent_step: int | None = None
        self.last_received_step: int | None = None
        memory.on_written = self.offer
        self._sender = threading.Thread(target=self._send_loop, name="trainwarden-peer-send", daemon=True)
        self._receiver = threading.Thread(target=self._receive_loop, name="trainwarden-peer-receive", daemon=True)
        self._sender.start()
        self._receiver.start()

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
                if self._pending is None:  # closing, nothing left
                    break
                step, file = self._pending
                self._pending = None
                self._sending = True
            try:
                self._send(step, file)
            except Exception as exc:  # a peer gone: the job restarts; the step must not notice
                self._fail(f"sending the snapshot of step {step} to rank {self.dest} failed ({type(exc).__name__}: "
                           f"{exc})")
                return
            finally:
                file.pinned = False
                with self._cond:
                    self._sending = False
                    self._cond.notify_all()
        try:
            dist.send(torch.tensor([_END, 0, 0, 0], dtype=torch.int64), group=self._group, group_dst=self.dest)
        except Exception as exc:
            log.debug("could not tell rank %d that copying ends: %s", self.dest, exc)

    def _send(self, step: int, file) -> None:
        with open(file.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        payload = torch.frombuffer(mapped, dtype=torch.uint8)
        dist.send(torch.tensor([_DATA, step, size, self.world_size], dtype=torch.int64), group=self._group,
                  group_dst=self.dest)
        dist.send(payload, group=self._group, group_dst=self.dest)
        del payload
        self.sent += 1
        self.last_sent_step = step

    # -- receiver ----------------------------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        while True:
            header = torch.zeros(4, dtype=torch.int64)
            try:
                dist.recv(header, group=self._group, group_src=self.source)
                kind, step, size, world = (int(v) for v in header)
                if kind == _END:
                    return
                self._receive(step, size, world)
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

    def close(self, timeout: float = 10.0) -> None:
        """Send what is pending, then the end; wait for the peer's end (both threads return)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._sender.join(timeout)
        self._receiver.join(timeout)
        if self.memory.on_written == self.offer:
            self.memory.on_written = None

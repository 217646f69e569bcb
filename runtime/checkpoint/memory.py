"""The Checkpointer's memory side: per-step snapshots, their copy on the next node, and restoring from them.

A mixin of ``Checkpointer`` (runtime/checkpoint/checkpointer.py), which keeps the disk side: saving, committing, retention and
the restore's plan and disk candidates. ``restore`` asks here first (``_memory_choice``) and falls back to the
disk when nothing here serves. What the memory holds and how it is read: runtime/checkpoint/memory_snapshot.py (the files),
runtime/checkpoint/memory_reshard.py (another world size or numbering, through DCP), runtime/checkpoint/memory_peer.py (the copy),
runtime/checkpoint/memory_sums.py (each tensor's checksum, verified before a restore uses it: a corrupt file is set aside and
the choice made again, so the peer's copy, an older step in memory or the disk serves instead).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainwarden.agent.shared.contract import PEER_COPY_ENV
from trainwarden.agent.shared.snapshot_layout import peer_path, snapshot_path
from trainwarden.runtime.checkpoint.errors import SAVE_LOAD_ERRORS, describe
from trainwarden.runtime.checkpoint.state import RNGState, put_back
from trainwarden.runtime.checkpoint.memory_peer import PeerCopy
from trainwarden.runtime.checkpoint.memory_reshard import Choice, SnapshotReader, choose, open_files
from trainwarden.runtime.checkpoint.memory_snapshot import MemorySnapshots, memory_dir_from_env
from trainwarden.runtime.checkpoint.memory_sums import Mismatch, set_aside
from trainwarden.runtime.session import current as current_session

__all__ = ["MemoryRestore"]

logger = logging.getLogger("trainwarden.runtime.checkpoint")  # one logger for the Checkpointer's lines

_MEMORY_CHOICES = 4
"""How many times a restore chooses a memory snapshot again after setting corrupt files aside, before the disk."""


class MemoryRestore:
    """Needs the Checkpointer's ``rank``, ``world_size``, ``_distributed``, ``_pg``, ``_events``, ``_closed``,
    ``_last_saved_step``, ``_group`` (its collectives) and ``_report``."""

    def _init_memory(self, memory_dir: str | Path | None | bool, ranks_per_node: int | None,
                     after_snapshot: Callable[[int, str], None] | None = None) -> None:
        """The Checkpointer's memory side, made in its ``__init__`` (collective on several nodes)."""
        if memory_dir is True:  # the node agent's, when it keeps snapshots
            memory_dir = memory_dir_from_env()
        self.memory: MemorySnapshots | None = None
        """Per-step snapshots in the agent's shared memory (``snapshot``); None without a memory directory."""
        if memory_dir:
            self.memory = MemorySnapshots(memory_dir, rank=self.rank, world_size=self.world_size,
                                          report=self._own_snapshot_written)
        self._after_snapshot = after_snapshot  # e.g. the fault injector's snapflip
        self.resumed_from_memory = False
        self._held: list[tuple[int, int, int]] = []  # the memory snapshot files this rank's node holds (restore)
        self.peer: PeerCopy | None = None
        """Sends this rank's newest snapshot to the next node and keeps that node's copy (runtime/checkpoint/memory_peer.py);
        None on one node, without memory snapshots on every rank, or with ``TRAINWARDEN_PEER_COPY=0``."""
        if self._distributed:
            self.peer = self._start_peer_copy(ranks_per_node)

    def snapshot(self, step: int, state: Mapping[str, Any]) -> bool:
        """Snapshot ``state`` after ``step`` into the node agent's memory (every step: a restart after a crash or
        a hang then resumes from here instead of the disk). Copies the state into host buffers and returns; the
        write is in the background. False when there is no memory directory or this step was skipped (the
        previous snapshot still being written). Never raises; disk checkpoints are unaffected."""
        if self.memory is None or self._closed:
            return False
        return self.memory.save(step, state)

    def _snapshot_written(self, step: int, path: str, seconds: float) -> None:
        self._report("snapshot", step, seconds=seconds, path=path)

    def _own_snapshot_written(self, step: int, path: str, seconds: float) -> None:
        self._snapshot_written(step, path, seconds)
        if self._after_snapshot is not None:
            self._after_snapshot(step, path)

    def _restore_memory(self, floor: int, state: Mapping[str, Any], began: float) -> int | None:
        """Collective: restore the newest memory snapshot every rank can use (``_memory_choice``); its step, or None
        (the disk's candidates follow). When a file's bytes differ from their sums it is set aside and the choice
        is made again: another copy of that step (the peer's), an older step still in memory, else the disk."""
        for _ in range(_MEMORY_CHOICES):
            choice = self._memory_choice(floor)
            if choice is None:
                return None
            restored, corrupt = (self._restore_from_memory(choice.step, state, began) if choice.own
                                 else self._restore_resharded(choice, state, began))
            if restored:
                return choice.step
            if not corrupt:
                return None
        return None

    def _report_corrupt(self, mismatches: list[Mismatch]) -> None:
        """Rank 0: one ``set_aside`` incident per corrupt snapshot file (every rank gathered the same list)."""
        if self.rank != 0:
            return
        by_file: dict[str, list[Mismatch]] = {}
        for mismatch in mismatches:
            by_file.setdefault(mismatch.file, []).append(mismatch)
        for path, found in sorted(by_file.items()):
            first = found[0]
            detail = (f"corrupt memory snapshot: rank {first.rank}'s {first.copy} copy of step {first.step} does not "
                      f"match the sums recorded when it was written: "
                      + "; ".join(f"buffer {m.buffer}: xxh3_64 {m.found}, recorded {m.expected}" for m in found[:4])
                      + (f" (and {len(found) - 4} more buffers)" if len(found) > 4 else "")
                      + f"; moved to {first.aside}; the restore uses another copy, an older step or the disk")
            logger.error("memory snapshot %s: %s", path, detail,
                         extra={"event": "snapshot_corrupt", "step": first.step})
            self._report("set_aside", first.step, path=path, detail=detail[:1000])

    def _peer_barrier(self) -> None:
        """Every rank has sent its last copy (PeerCopy.close); bounded, so a rank gone costs 30 s, not a hang."""
        if self._pg is not None and dist.get_backend(self._pg) == "gloo":
            dist.monitored_barrier(group=self._pg, timeout=dt.timedelta(seconds=30))

    def _start_peer_copy(self, ranks_per_node: int | None) -> PeerCopy | None:
        """Collective (every rank makes its Checkpointer): a PeerCopy when the job spans nodes and every rank keeps
        memory snapshots (decided together: making its group is collective too)."""
        if ranks_per_node is None:
            try:
                ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or self.world_size)
            except ValueError:
                ranks_per_node = self.world_size
        if not 0 < ranks_per_node < self.world_size or self.world_size % ranks_per_node:
            return None  # one node (or nodes of different sizes: no next node to pair with)
        wanted = self.memory is not None and os.environ.get(PEER_COPY_ENV, "1").strip() != "0"
        if not all(self._group.gather(wanted)):
            if self.rank == 0 and wanted:
                logger.info("memory snapshots are not copied to other nodes: not every rank keeps them (a node "
                            "without them, or %s=0 there); a node loss restores from disk", PEER_COPY_ENV)
            return None
        return PeerCopy(self.memory, rank=self.rank, world_size=self.world_size, ranks_per_node=ranks_per_node,
                        report=self._snapshot_written)

    def _restore_from_memory(self, step: int, state: Mapping[str, Any], began: float) -> tuple[bool, bool]:
        """Every rank loads its own memory snapshot of ``step``; (whether all did, whether a file was corrupt and
        set aside). Otherwise the next source loads over whatever part of the snapshot was loaded."""
        error = self.memory.load(step, state) if self.memory is not None else "no memory directory"
        corrupt = set_aside(self.memory.mismatches) if self.memory is not None and self.memory.mismatches else []
        gathered = self._group.gather((error, corrupt))
        failed = {r: e for r, (e, _) in enumerate(gathered) if e}
        corrupt = [m for _, found in gathered for m in found]
        self._report_corrupt(corrupt)
        if failed:
            if self.rank == 0:
                logger.warning("not restoring step %d from memory (%s); %s", step,
                               "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))[:1500],
                               "choosing again without the corrupt files" if corrupt else
                               "restoring from the disk checkpoints",
                               extra={"event": "snapshot_unusable", "step": step})
            return False, bool(corrupt)
        self._memory_resumed(step, began, lambda seconds: (
            f"the memory snapshot of step {step} in {seconds:.3f} s (the newest disk checkpoint is older or the "
            "same)"))
        return True, False

    def _memory_resumed(self, step: int, began: float, what: Callable[[float], str]) -> None:
        """The state is the memory snapshot of ``step``: say so (``what(seconds)`` completes "resumed from")."""
        self._last_saved_step = None  # the disk has no checkpoint of this step: a save of it is a real one
        self.resumed_from_memory = True
        seconds = time.monotonic() - began
        if self.rank == 0:
            logger.info("resumed from %s", what(seconds), extra={"event": "checkpoint_resume", "step": step})
        self._report("restored", step, seconds=seconds, path=str(self.memory.directory if self.memory else ""))

    def _memory_held(self) -> list[tuple[int, int, int]]:
        """(world size, rank, step) of the snapshot files this rank's node agent (the memory's owner) vouches for
        and that are here: none after that agent restarted."""
        if self.memory is None:
            return []
        session = self._events or current_session()
        try:
            ask_all = getattr(session, "memory_held", None)
            if ask_all is not None:
                vouched = ask_all(self.world_size)
            else:  # a session that answers for this rank only
                ask = getattr(session, "memory_steps", None)
                vouched = [(self.world_size, self.rank, s) for s in (ask(self.world_size) if ask else [])]
        except Exception as exc:
            logger.warning("could not ask the node agent for the memory snapshots it holds (%s)", exc)
            return []
        return [(w, r, s) for w, r, s in vouched if self._memory_file(w, r, s) is not None]

    def _memory_file(self, world: int, rank: int, step: int) -> Path | None:
        """A snapshot file on this node: the rank's own, or the copy a peer node sent here."""
        for path in (snapshot_path(self.memory.directory, world, rank, step),
                     peer_path(self.memory.directory, world, rank, step)):
            if path.is_file():
                return path
        return None

    def _memory_choice(self, floor: int) -> Choice | None:
        """Collective: the newest step of which the ranks' nodes hold every rank's memory snapshot (at this world
        size or another), or None. A snapshot older than ``floor`` (what the disk holds or etcd says was
        committed) is never used."""
        self._held = self._memory_held()
        everyone = self._group.gather(self._held)
        choice = choose(everyone, self.world_size, floor)
        if self.rank == 0 and choice is None and any(everyone):
            newest = choose(everyone, self.world_size, -1)
            logger.info("restoring from disk, not memory: %s", (
                f"the newest memory snapshot of every rank (step {newest.step}) is older than the disk's (step "
                f"{floor})" if newest is not None else "no step is in every rank's memory snapshots"))
        return choice

    def _restore_resharded(self, choice: Choice, state: Mapping[str, Any], began: float) -> tuple[bool, bool]:
        """Collective: load the memory snapshots of ``choice`` through DCP (another world size, or files on other
        nodes: runtime/checkpoint/memory_reshard.py); (whether every rank did, whether a file was corrupt and set aside).
        Each tensor a rank reads from a file on its node, for itself or to send, is verified first (SnapshotReader)."""
        held = {r: path for w, r, s in self._held
                if (w, s) == (choice.world, choice.step) and (path := self._memory_file(w, r, s)) is not None}
        mapped, errors = open_files(held, choice.step, choice.world)
        mine = {r: mapped[r].header for r, q in choice.holders.items() if q == self.rank and r in mapped}
        missing = [r for r, q in choice.holders.items() if q == self.rank and r not in mapped]
        gathered = self._group.gather((mine, {r: errors.get(r, "its file is gone") for r in missing}))
        headers = {r: h for part, _ in gathered for r, h in part.items()}
        failed = {r: e for _, part in gathered for r, e in part.items()}
        error, received, corrupt = "", 0, []
        if not failed:
            dcp_state = {k: v for k, v in state.items() if not isinstance(v, RNGState)}
            reader = None
            try:
                reader = SnapshotReader(headers, mapped, choice.holders, rank=self.rank, group=self._pg)
                dcp.load(dcp_state, storage_reader=reader, process_group=self._pg, no_dist=not self._distributed)
                received = reader.received_bytes
                for name, value in dcp_state.items():
                    if not hasattr(value, "state_dict"):
                        put_back(state, name, value)
            except SAVE_LOAD_ERRORS as exc:
                error = describe(exc)
            found = set_aside(reader.mismatches) if reader is not None and reader.mismatches else []
            outcomes = self._group.gather((error, received, found))
            errors_everywhere = {r: e for r, (e, _, _) in enumerate(outcomes) if e}
            received = sum(n for _, n, _ in outcomes)
            corrupt = list(dict.fromkeys(m for _, _, found in outcomes for m in found))  # ranks of a node: once
            self._report_corrupt(corrupt)
        else:
            errors_everywhere = {}
        for snapshot in mapped.values():
            snapshot.close()
        if failed or errors_everywhere:
            if self.rank == 0:
                why = "; ".join([f"rank {r}'s file: {e}" for r, e in sorted(failed.items())]
                                + [f"rank {r}: {e}" for r, e in sorted(errors_everywhere.items())])
                logger.warning("not restoring step %d from the memory snapshots taken at world size %d (%s); %s",
                               choice.step, choice.world, why[:1500], "choosing again without the corrupt files"
                               if corrupt else "restoring from the disk checkpoints",
                               extra={"event": "snapshot_unusable", "step": choice.step})
            return False, bool(corrupt)
        crossed = f"{received / 2**20:.1f} MiB" if received >= 2**20 else f"{received / 1024:.1f} KiB"
        self._memory_resumed(choice.step, began, lambda seconds: (
            f"the memory snapshots of step {choice.step} taken at world size {choice.world}, now {self.world_size}, "
            f"resharded by DCP, in {seconds:.3f} s ({crossed} crossed between nodes; RNG states not restored: they "
            "are per rank; the newest disk checkpoint is older or the same)"))
        return True, False

"""Restore memory snapshots whose files are not each rank's own: ``choose`` and ``SnapshotReader``.

A rank's snapshot file (runtime/checkpoint/memory_snapshot.py) holds what that rank owned: the local shards of its DTensors. The
same rank at the same world size loads it directly. Two restarts cannot: one into another world size (a node lost or
back: the shards are cut differently), and one where a rank's file is on another node than the rank (the ranks were
numbered anew). For them each file also records, once per layout, DCP's view of its state (``_dcp_view``: each
tensor's flattened key, global size and where this rank's chunk sits in it), and this module hands the set of files
of one step to ``dcp.load`` as a storage reader. DCP's own load planner then works out which chunks each new rank
reads, exactly as from a disk checkpoint, so resharding is DCP's, not ours.

Where the bytes come from: each node's agent vouches for the files in its memory directory (agent
``launch/memory_tier.py``); the ranks all-gather what their agents vouch for (``choose``) and take the newest step
of which some rank holds every old rank's file. Each rank reads the chunks it needs from the files on its own node
(mapped: no copy until the copy into the live tensor); a chunk only another node holds is sent by the lowest rank
that holds it, over the Checkpointer's gloo group, inside ``read_data`` (which every rank calls: DCP's read step is
collective). The headers of the chosen files are small and all-gathered before the load, so every rank builds the
same metadata.

What it refuses (the caller then restores from disk): a file that is torn, rewritten while read, or made before this
format recorded DCP's view; a body whose structure no longer matches the view; a value that holds tensors in a file
on another node. Each tensor a rank reads from a file on its node (for itself, or to send) is verified against its
sum first (runtime/checkpoint/memory_sums.py): a mismatch fails the load and is kept in ``SnapshotReader.mismatches``, and the
caller sets the file aside and chooses again. What it does not restore: RNG states (per-rank, like a disk checkpoint at another world size).
"""

from __future__ import annotations

import io
import pickle
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from trainwarden.runtime.checkpoint.memory_snapshot import MappedSnapshot, follow, holds_tensor_mark
from trainwarden.runtime.checkpoint.memory_sums import Mismatch

__all__ = ["Choice", "SnapshotReader", "choose"]

log = logging.getLogger(__name__)

Held = tuple[int, int, int]
"""(world size, rank, step) of a snapshot file a rank's node agent vouches for and that is on the rank's node."""

_ALIGN = 64


@dataclass(frozen=True)
class Choice:
    world: int
    """The world size the files were taken at."""
    step: int
    holders: dict[int, int]
    """Each old rank -> the lowest new rank whose node holds its file of ``step``."""
    own: bool
    """Every new rank holds its own file (same world size, same rank): each loads its own, RNG states included."""


def choose(everyone: list[list[Held]], world_size: int, floor: int) -> Choice | None:
    """The newest step ≥ ``floor`` of which the new ranks (``everyone[q]``: what rank ``q``'s node holds) hold every
    old rank's file, at any world size; at the same step, the current world size first. None when there is none."""
    covered: dict[tuple[int, int], dict[int, int]] = {}  # (world, step) -> old rank -> lowest holder
    for holder, held in enumerate(everyone):
        for world, rank, step in held:
            if 0 <= rank < world:
                covered.setdefault((world, step), {}).setdefault(rank, holder)
    complete = [(step, world == world_size, world) for (world, step), ranks in covered.items()
                if len(ranks) == world and step >= floor]
    if not complete:
        return None
    step, _, world = max(complete)
    holders = covered[(world, step)]
    own = world == world_size and all((world, q, step) in set(everyone[q]) for q in range(world_size))
    return Choice(world=world, step=step, holders=dict(sorted(holders.items())), own=own)


def metadata(headers: dict[int, dict]) -> tuple[Metadata, dict[MetadataIndex, list[tuple[int, Any]]]]:
    """DCP metadata of a step's files (``headers``: old rank -> its file's header) and where each item is: for a
    tensor chunk, the old ranks holding it with its index in their tensor table; for a value, its path."""
    entries: dict[str, Any] = {}
    where: dict[MetadataIndex, list[tuple[int, Any]]] = {}
    for rank in sorted(headers):
        header = headers[rank]
        view, table = header.get("dcp"), header["tensors"]
        if not isinstance(view, dict):
            raise ValueError(f"rank {rank}'s snapshot records no DCP view (taken by an older trainwarden, or of a "
                             "state DCP cannot place)")
        for fqn, _path, index, size, offsets, sizes in view["tensors"]:
            dtype = getattr(torch, table[index][0])
            entry = entries.get(fqn)
            if entry is None:
                entry = entries[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype),
                                                             size=torch.Size(size), chunks=[])
            elif not isinstance(entry, TensorStorageMetadata) or tuple(entry.size) != tuple(size):
                raise ValueError(f"{fqn}: ranks' snapshots disagree on its size or kind")
            key = MetadataIndex(fqn, offsets)
            if key not in where:
                entry.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
                where[key] = []
            where[key].append((rank, index))
        for fqn, path in view["values"]:
            if isinstance(entries.setdefault(fqn, BytesStorageMetadata()), TensorStorageMetadata):
                raise ValueError(f"{fqn}: a tensor in one rank's snapshot, a value in another's")
            where.setdefault(MetadataIndex(fqn), []).append((rank, path))
    return Metadata(state_dict_metadata=entries, storage_data=where), where


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


class SnapshotReader(StorageReader):
    """DCP storage reader over one step's snapshot files (see the module's docstring). ``local``: the files on this
    rank's node, by old rank; ``holders``: which new rank sends each old rank's chunks; ``group``: the gloo group
    every rank of the new world is in (global rank = group rank)."""

    def __init__(self, headers: dict[int, dict], local: dict[int, MappedSnapshot], holders: dict[int, int], *,
                 rank: int, group=None) -> None:
        super().__init__()
        self._metadata, self._where = metadata(headers)
        self._headers, self._local, self._holders = headers, local, holders
        self._rank, self._group = rank, group
        self.sent_bytes = self.received_bytes = 0
        self.mismatches: list[Mismatch] = []
        """The tensors of files on this node whose bytes differ from their sums (runtime/checkpoint/memory_sums.py)."""
        self._verified: set[tuple[int, int]] = set()

    # -- StorageReader ---------------------------------------------------------------------------------------

    def reset(self, checkpoint_id=None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        """Every rank calls this (DCP's read step): the exchange between nodes comes first and always runs, so a
        rank whose own reads fail still serves the others; its failure is raised after it (DCP then fails the
        load on every rank)."""
        local, remote, values = [], [], []
        for item in plan.items:
            sources = self._where[item.storage_index]
            if item.type == LoadItemType.BYTE_IO:
                values.append((item, sources))
                continue
            here = [(rank, index) for rank, index in sources if rank in self._local]
            if here:
                local.append((item, *here[0]))
            else:
                remote.append((item, *sources[0]))
        errors: list[str] = []
        self._exchange(remote, planner, errors)
        for item, rank, index in local:
            self._guarded(errors, item, lambda: self._put(item, planner, _narrow(
                self._tensor(rank, index), item.storage_offsets, item.lengths)))
        for item, sources in values:
            self._guarded(errors, item, lambda: self._read_value(item, planner, sources))
        for mapped in self._local.values():
            try:
                mapped.check()
            except (OSError, ValueError) as exc:
                errors.append(str(exc))
        if errors:
            raise ValueError(f"{len(errors)} reads failed: " + "; ".join(errors[:3]))
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    @staticmethod
    def _guarded(errors: list[str], item: ReadItem, read) -> None:
        try:
            read()
        except Exception as exc:
            errors.append(f"{item.dest_index.fqn}: {type(exc).__name__}: {exc}")

    # -- the parts --------------------------------------------------------------------------------------------

    def _read_value(self, item: ReadItem, planner: LoadPlanner, sources: list[tuple[int, Any]]) -> None:
        here = [(rank, path) for rank, path in sources if rank in self._local]
        rank, path = (here or sources)[0]
        if rank in self._local:
            if holds_tensor_mark(follow(self._headers[rank], path)):
                self._check(rank, range(len(self._headers[rank]["tensors"])))
            value = self._local[rank].value(path)
        else:  # the header is here; only a value holding tensors would need the file
            value = _value(self._headers[rank], path)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        planner.load_bytes(item, buffer)

    def _check(self, rank: int, indices) -> None:
        """Verify old rank ``rank``'s tensors at ``indices`` in the file on this node against their sums, each once:
        a mismatch is kept in ``mismatches`` and raised, so DCP fails the load on every rank and nothing of it is
        used (runtime/checkpoint/memory.py then sets the file aside and chooses again)."""
        todo = [i for i in indices if (rank, i) not in self._verified]
        if not todo:
            return
        found = self._local[rank].verify(todo)
        if found:
            self.mismatches += found
            raise ValueError(f"does not match its sums: {found[0]}")
        self._verified.update((rank, i) for i in todo)

    def _tensor(self, rank: int, index: int) -> torch.Tensor:
        """A view of old rank ``rank``'s tensor ``index`` in the file on this node, verified first (``_check``)."""
        self._check(rank, (index,))
        return self._local[rank].tensor(index)

    @staticmethod
    def _put(item: ReadItem, planner: LoadPlanner, source: torch.Tensor) -> None:
        target = planner.resolve_tensor(item).detach()
        if target.shape != source.shape:
            raise ValueError(f"{item.dest_index.fqn}: a chunk of {tuple(source.shape)} for a target of "
                             f"{tuple(target.shape)}")
        target.copy_(source)
        planner.commit_tensor(item, target)

    def _nbytes(self, rank: int, index: int, lengths) -> int:
        dtype = getattr(torch, self._headers[rank]["tensors"][index][0])
        count = 1
        for length in lengths:
            count *= int(length)
        return count * dtype.itemsize

    def _exchange(self, remote: list[tuple[ReadItem, int, int]], planner: LoadPlanner, errors: list[str]) -> None:
        """Collective: every rank says which chunks it needs from which holder; each holder sends each asker its
        chunks in one buffer (each at a 64-byte aligned offset), and each asker copies them into its tensors."""
        if not (dist.is_available() and dist.is_initialized()):  # one process: every file must be here
            errors.extend(f"{item.dest_index.fqn}: rank {rank}'s file is not here" for item, rank, _ in remote)
            return
        asks = [(self._holders[rank], rank, index, tuple(item.storage_offsets), tuple(item.lengths))
                for item, rank, index in remote]
        world = dist.get_world_size(self._group)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, asks, group=self._group)
        works, outgoing, incoming = [], [], {}
        for asker, wanted in enumerate(everyone):
            mine = [(rank, index, offsets, lengths) for holder, rank, index, offsets, lengths in wanted
                    if holder == self._rank]
            if asker == self._rank or not mine:
                continue
            sizes = [self._nbytes(rank, index, lengths) for rank, index, _, lengths in mine]
            payload = torch.zeros(sum(_aligned(n) for n in sizes), dtype=torch.uint8)
            at = 0
            for (rank, index, offsets, lengths), n in zip(mine, sizes):
                try:  # a chunk that cannot be read goes as zeros; the failure is raised after the exchange
                    chunk = _narrow(self._tensor(rank, index), offsets, lengths).contiguous()
                    payload[at:at + n].copy_(chunk.reshape(-1).view(torch.uint8))
                except Exception as exc:
                    errors.append(f"rank {rank}'s tensor {index} for rank {asker}: {type(exc).__name__}: {exc}")
                at += _aligned(n)
            outgoing.append(payload)
            works.append(dist.isend(payload, group=self._group, group_dst=asker))
            self.sent_bytes += payload.numel()
        by_holder: dict[int, list[tuple[ReadItem, int, int]]] = {}
        for item, rank, index in remote:
            by_holder.setdefault(self._holders[rank], []).append((item, rank, index))
        for holder, items in sorted(by_holder.items()):
            total = sum(_aligned(self._nbytes(rank, index, item.lengths)) for item, rank, index in items)
            incoming[holder] = torch.empty(total, dtype=torch.uint8)
            works.append(dist.irecv(incoming[holder], group=self._group, group_src=holder))
            self.received_bytes += total
        for work in works:
            work.wait()
        for holder, items in by_holder.items():
            buffer, at = incoming[holder], 0
            for item, rank, index in items:
                n = self._nbytes(rank, index, item.lengths)
                dtype = getattr(torch, self._headers[rank]["tensors"][index][0])
                chunk = buffer[at:at + n]
                self._guarded(errors, item, lambda: self._put(item, planner, chunk.view(dtype).view(
                    tuple(item.lengths))))
                at += _aligned(n)


def _value(header: dict, path: tuple) -> Any:
    """A value of a snapshot's body from its header alone; ValueError when it holds a tensor (in the file)."""
    value = follow(header, path)
    if holds_tensor_mark(value):
        raise ValueError(f"{'.'.join(map(str, path))} holds tensors in a snapshot file on another node")
    return value


def open_files(paths: dict[int, Path], step: int, world: int) -> tuple[dict[int, MappedSnapshot], dict[int, str]]:
    """Map each old rank's file (``paths``); (mapped, errors by old rank). A file of another step, rank or world
    size, or one whose body no longer matches its DCP view, is an error."""
    mapped, errors = {}, {}
    for rank, path in paths.items():
        try:
            snapshot = MappedSnapshot(path)
            body = snapshot.header["body"]
            if (body.get("step"), body.get("rank"), body.get("world_size")) != (step, rank, world):
                raise ValueError(f"holds step {body.get('step')} of rank {body.get('rank')} at world size "
                                 f"{body.get('world_size')}")
            view = snapshot.header.get("dcp")
            if not isinstance(view, dict):
                raise ValueError("records no DCP view (taken by an older trainwarden, or of a state DCP cannot "
                                 "place)")
            for fqn, path_in_body, index, *_ in view["tensors"]:
                if not snapshot.holds_tensor(tuple(path_in_body), index):
                    raise ValueError(f"its state changed structure since the file was made ({fqn})")
            mapped[rank] = snapshot
        except (OSError, ValueError, KeyError, TypeError, EOFError, pickle.UnpicklingError) as exc:
            errors[rank] = f"{path}: {type(exc).__name__}: {exc}"
    return mapped, errors

"""Checksums of memory snapshots (issue 48, item 1; runtime/checkpoint/memory_sums.py): recorded by the writer thread, verified
before a restore uses a file; a mismatch sets the file aside and the restore takes the next source.

Real tensors, a real optimizer, real snapshot files in a temporary directory; the byte is flipped by the ``snapflip``
fault's own code. Several ranks, the peer's copy and the resharded path: tests/integration/test_memory_sums.py."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
import xxhash

from trainwarden.agent.shared.snapshot_layout import peer_path, snapshot_path
from trainwarden.runtime.checkpoint import Checkpointer
from trainwarden.runtime.faults import FaultInjector, parse_faults
from trainwarden.runtime.checkpoint.memory_snapshot import MappedSnapshot, MemorySnapshots
from trainwarden.runtime.checkpoint.memory_sums import CORRUPT_SUFFIX, SnapshotCorrupt

from unit.test_memory_snapshot import _Agent, _job, _params, _train

pytestmark = pytest.mark.timeout(120)


def _snapshotted(tmp_path, steps=(1, 2), *, sums=True):
    model, optimizer, state = _job()
    snaps = MemorySnapshots(tmp_path, rank=0, world_size=1, sums=sums)
    for step in steps:
        _train(model, optimizer, state, step)
        assert snaps.save(step, state)
        snaps.wait()
    snaps.close()
    return model, state


def _flip(path, step: int) -> None:
    injector = FaultInjector(parse_faults(f"snapflip:rank=0,step={step}"), rank=0)
    injector.after_snapshot(step, str(path))


def test_each_tensor_sum_is_recorded_from_the_bytes_written_and_a_clean_file_verifies(tmp_path):
    _snapshotted(tmp_path)
    snapshot = MappedSnapshot(snapshot_path(tmp_path, 1, 0, 2))
    sums = snapshot.header["sums"]
    assert sums["algorithm"] == "xxh3_64" and len(sums["tensors"]) == len(snapshot.header["tensors"])
    for index, recorded in enumerate(sums["tensors"]):
        raw = snapshot.tensor(index).reshape(-1).view(torch.uint8).numpy().tobytes()
        assert recorded == xxhash.xxh3_64_hexdigest(raw)
    assert snapshot.verify() == []
    snapshot.close()


def test_a_flipped_byte_is_refused_before_anything_is_loaded_naming_rank_copy_buffer_and_both_sums(tmp_path):
    _snapshotted(tmp_path)
    path = snapshot_path(tmp_path, 1, 0, 2)
    _flip(path, 2)
    fresh_model, _, fresh_state = _job(seed=7)
    before = _params(fresh_model)
    snaps = MemorySnapshots(tmp_path, rank=0, world_size=1)
    error = snaps.load(2, fresh_state)
    assert "does not match its sums" in error
    [mismatch] = snaps.mismatches
    assert (mismatch.file, mismatch.rank, mismatch.step, mismatch.copy) == (str(path), 0, 2, "own")
    assert mismatch.buffer.startswith("app/") and "(tensor " in mismatch.buffer, mismatch.buffer
    assert mismatch.expected != mismatch.found and mismatch.expected in error and mismatch.found in error
    assert all(torch.equal(a, b) for a, b in zip(before, fresh_model.parameters()))  # nothing of it was loaded
    assert snaps.load(1, fresh_state) == "" and snaps.mismatches == []  # the older file is whole
    snaps.close()


def test_the_peer_copy_carries_the_sums_and_its_corruption_is_named_as_the_peers(tmp_path):
    _snapshotted(tmp_path)
    copy = peer_path(tmp_path, 1, 0, 2)
    copy.parent.mkdir(parents=True)
    shutil.copy(snapshot_path(tmp_path, 1, 0, 2), copy)  # the bytes a peer node receives
    assert MappedSnapshot(copy).verify() == []
    _flip(copy, 2)
    [mismatch] = MappedSnapshot(copy).verify()
    assert mismatch.copy == "peer" and mismatch.rank == 0
    with pytest.raises(SnapshotCorrupt, match="rank 0's peer copy of step 2"):
        from trainwarden.runtime.checkpoint.memory_snapshot import _load
        _load(copy)


def test_a_file_written_without_sums_loads_unverified(tmp_path):
    model, _ = _snapshotted(tmp_path, sums=False)
    path = snapshot_path(tmp_path, 1, 0, 2)
    assert MappedSnapshot(path).header["sums"] is None
    fresh_model, _, fresh_state = _job(seed=7)
    assert MemorySnapshots(tmp_path, rank=0, world_size=1).load(2, fresh_state) == ""
    assert all(torch.equal(a, b) for a, b in zip(_params(model), fresh_model.parameters()))


def _checkpointed(tmp_path, *, flip: tuple[int, ...]):
    """Snapshots of steps 1..7 (the agent keeps 6 and 7), a disk checkpoint of step 5; ``flip``: the snapflip fault
    corrupts those steps' snapshots once written, through the Checkpointer's ``after_snapshot``."""
    model, optimizer, state = _job()
    injectors = {s: FaultInjector(parse_faults(f"snapflip:rank=0,step={s}"), rank=0) for s in flip}

    def after_snapshot(step: int, path: str) -> None:
        if step in injectors:
            injectors[step].after_snapshot(step, path)

    ckpt = Checkpointer(tmp_path / "ckpt", session=_Agent(), memory_dir=tmp_path / "mem", read_backoff_s=(),
                        after_snapshot=after_snapshot)
    weights = {}
    for step in range(1, 8):
        _train(model, optimizer, state, step)
        weights[step] = _params(model)
        assert ckpt.snapshot(step, state)
        ckpt.memory.wait()
        if step == 5:
            ckpt.save(step, state)
            ckpt.wait()
    ckpt.close()
    return weights, _Agent(record=5, memory=[7, 6])


def test_restore_sets_a_corrupt_snapshot_aside_with_one_incident_and_takes_the_older_memory_step(tmp_path, caplog):
    weights, agent = _checkpointed(tmp_path, flip=(7,))
    model, _, state = _job(seed=3)
    ckpt = Checkpointer(tmp_path / "ckpt", session=agent, memory_dir=tmp_path / "mem", read_backoff_s=())
    with caplog.at_level(logging.INFO):
        assert ckpt.restore(state) == 6 and ckpt.resumed_from_memory
    ckpt.close()
    assert all(torch.equal(a, b) for a, b in zip(weights[6], model.parameters()))
    corrupt = snapshot_path(tmp_path / "mem", 1, 0, 7)
    assert not corrupt.exists() and corrupt.with_name(corrupt.name + CORRUPT_SUFFIX).is_file()  # kept, out of the way
    aside = [s for s in agent.stages if s[0] == "set_aside"]
    assert aside == [("set_aside", 7, str(corrupt))]  # one incident, naming the file
    [line] = [r.message for r in caplog.records if getattr(r, "event", "") == "snapshot_corrupt"]
    assert "rank 0's own copy of step 7" in line and "xxh3_64" in line and "recorded" in line and "buffer app/" in line


def test_every_memory_step_corrupt_falls_back_to_the_disk_checkpoint_never_step_1(tmp_path):
    weights, agent = _checkpointed(tmp_path, flip=(6, 7))
    model, _, state = _job(seed=3)
    ckpt = Checkpointer(tmp_path / "ckpt", session=agent, memory_dir=tmp_path / "mem", read_backoff_s=())
    assert ckpt.restore(state) == 5 and not ckpt.resumed_from_memory
    ckpt.close()
    assert all(torch.equal(a, b) for a, b in zip(weights[5], model.parameters()))
    assert [s[1] for s in agent.stages if s[0] == "set_aside"] == [7, 6]


def test_snapflip_fires_once_on_the_first_snapshot_of_its_step_or_later_never_at_a_step_boundary(tmp_path):
    [fault] = parse_faults("snapflip:rank=1,step=4")
    assert fault.describe() == "snapflip:rank=1,step=4"
    _snapshotted(tmp_path, steps=(3, 5))
    injector = FaultInjector([fault], rank=1, state_dir=tmp_path / "state")
    injector.step_boundary(4)  # nothing: it waits for a snapshot
    injector.after_snapshot(3, str(snapshot_path(tmp_path, 1, 0, 3)))  # too early
    assert MappedSnapshot(snapshot_path(tmp_path, 1, 0, 3)).verify() == []
    injector.after_snapshot(5, str(snapshot_path(tmp_path, 1, 0, 5)))  # step 4's was skipped: the next one
    assert len(MappedSnapshot(snapshot_path(tmp_path, 1, 0, 5)).verify()) == 1
    injector.after_snapshot(5, str(snapshot_path(tmp_path, 1, 0, 5)))  # once: not flipped back
    assert len(MappedSnapshot(snapshot_path(tmp_path, 1, 0, 5)).verify()) == 1
    assert FaultInjector([fault], rank=0).armed is False


def test_dcp_through_the_reader_refuses_a_corrupt_tensor_and_keeps_what_it_found(tmp_path):
    import torch.distributed.checkpoint as dcp

    from trainwarden.runtime.checkpoint.errors import SAVE_LOAD_ERRORS
    from trainwarden.runtime.checkpoint.memory_reshard import SnapshotReader, open_files

    _snapshotted(tmp_path)
    path = snapshot_path(tmp_path, 1, 0, 2)
    _flip(path, 2)
    mapped, errors = open_files({0: path}, 2, 1)
    assert errors == {}
    fresh_model, _, fresh = _job(seed=7)
    fresh.pop("rng")  # not restored through DCP (per rank)
    reader = SnapshotReader({0: mapped[0].header}, mapped, {0: 0}, rank=0)
    with pytest.raises(SAVE_LOAD_ERRORS):  # DCP wraps the reader's ValueError ("does not match its sums")
        dcp.load(fresh, storage_reader=reader, no_dist=True)
    [mismatch] = reader.mismatches
    assert mismatch.file == str(path) and mismatch.buffer.startswith("app/") and mismatch.copy == "own"

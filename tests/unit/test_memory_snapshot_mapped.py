"""Memory snapshots staged straight into files mapped from the tmpfs (runtime/checkpoint/memory_snapshot.py, issue 26): each
rank's files are reused across steps, the newest complete one is never touched while another is filled, a state
whose tensors change gets new files, a full tmpfs turns snapshots off (never a SIGBUS in the step), and the loader
refuses a file that is not the one it asked for."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from trainwarden.agent.shared.snapshot_layout import partial_path, rank_partials, rank_snapshots, snapshot_path
from trainwarden.runtime.checkpoint.memory_snapshot import MemorySnapshots, _load

pytestmark = pytest.mark.timeout(120)


def _state(step: int, n: int = 1000) -> dict:
    return {"w": torch.arange(float(n)) * step, "b": {"m": torch.full((3, 4), float(step)), "count": step}}


class _Entry:
    """A state entry as the Checkpointer's are: ``load`` fills what ``state_dict()`` gives, then hands it back."""

    def __init__(self, values: dict) -> None:
        self.values = values

    def state_dict(self) -> dict:
        return self.values

    def load_state_dict(self, values: dict) -> None:
        self.values = values


def _steps(root, rank: int = 0, world: int = 1) -> list[int]:
    return [step for step, _ in rank_snapshots(root, world, rank)]


def _inode(root, step: int) -> int:
    return snapshot_path(root, 1, 0, step).stat().st_ino


def _loaded(root, step: int) -> dict:
    return _load(snapshot_path(root, 1, 0, step))["state"]


def test_each_snapshot_reuses_the_oldest_file_and_leaves_the_newest_alone(tmp_path):
    snaps = MemorySnapshots(tmp_path, rank=0, world_size=1)
    inodes = {}
    for step in (1, 2, 3, 4, 5):
        assert snaps.save(step, _state(step))
        snaps.wait()
        inodes[step] = _inode(tmp_path, step)
        assert _steps(tmp_path) == [step, step - 1][:step]  # KEEP: two files, the newest two steps
        assert rank_partials(tmp_path, 1, 0) == []
    assert inodes[1] == inodes[3] == inodes[5] and inodes[2] == inodes[4] and inodes[1] != inodes[2]
    for step in (4, 5):  # both complete, each its own step's values
        back = _loaded(tmp_path, step)
        assert torch.equal(back["w"], _state(step)["w"]) and back["b"]["count"] == step
    snaps.close()
    assert _steps(tmp_path) == [5, 4]  # closing unmaps; the files stay (the agent owns them)


def test_a_copy_that_fails_midway_leaves_the_newest_snapshot_intact(tmp_path, caplog):
    snaps = MemorySnapshots(tmp_path, rank=0, world_size=1)
    for step in (1, 2):
        assert snaps.save(step, _state(step))
        snaps.wait()
    newest = snapshot_path(tmp_path, 1, 0, 2).read_bytes()
    broken = _state(3)
    broken["b"]["m"] = torch.empty(3, 4, device="meta")  # the same layout; its copy fails after "w" is copied
    assert not snaps.save(3, broken)
    assert not snaps.enabled and [r for r in caplog.records if "memory snapshots are off" in r.message]
    assert _steps(tmp_path) == [2] and rank_partials(tmp_path, 1, 0) == []  # step 1's file was the one taken
    assert snapshot_path(tmp_path, 1, 0, 2).read_bytes() == newest
    assert torch.equal(_loaded(tmp_path, 2)["w"], _state(2)["w"])
    snaps.close()


def test_a_worker_killed_midway_through_a_copy_leaves_the_newest_snapshot_and_the_next_one_sweeps_its_file(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import trainwarden.runtime.checkpoint.memory_snapshot as ms
        from test_memory_snapshot_mapped import _state
        snaps = ms.MemorySnapshots({str(tmp_path)!r}, rank=0, world_size=1)
        for step in (1, 2):
            state = _state(step)
            snaps.save(step, {{"w": {{"w": state["w"]}}, "b": state["b"]}})
            snaps.wait()

        def dying(buffers, sources, non_blocking):
            buffers[0].fill_(-1.0)  # part of the copy, into the file step 1 was in
            os.kill(os.getpid(), signal.SIGKILL)

        ms._copy = dying
        state = _state(3)
        snaps.save(3, {{"w": {{"w": state["w"]}}, "b": state["b"]}})
    """)
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
    assert child.returncode == -9, child.stderr
    assert _steps(tmp_path) == [2] and rank_partials(tmp_path, 1, 0) == [partial_path(tmp_path, 1, 0, 3)]
    fresh = {"w": _Entry({"w": torch.zeros(1000)}), "b": _Entry({"m": torch.zeros(3, 4), "count": 0})}
    assert MemorySnapshots(tmp_path, rank=0, world_size=1).load(2, fresh) == ""
    assert torch.equal(fresh["w"].values["w"], _state(2)["w"]) and fresh["b"].values["count"] == 2
    snaps = MemorySnapshots(tmp_path, rank=0, world_size=1)  # the restarted worker
    assert snaps.save(3, {"w": {"w": _state(3)["w"]}, "b": _state(3)["b"]})
    snaps.wait()
    assert _steps(tmp_path) == [3, 2] and rank_partials(tmp_path, 1, 0) == []
    snaps.close()


def test_a_state_whose_tensors_change_gets_new_files_and_never_a_corrupt_one(tmp_path):
    snaps = MemorySnapshots(tmp_path, rank=0, world_size=1)
    for step in (1, 2):
        snaps.save(step, _state(step))
        snaps.wait()
    size = snapshot_path(tmp_path, 1, 0, 2).stat().st_size
    grown = _state(3, n=5000)  # another shape
    assert snaps.save(3, grown)
    snaps.wait()
    assert _steps(tmp_path) == [3, 2] and snapshot_path(tmp_path, 1, 0, 3).stat().st_size >= size + 4 * 4000
    assert torch.equal(_loaded(tmp_path, 3)["w"], grown["w"])
    assert torch.equal(_loaded(tmp_path, 2)["w"], _state(2)["w"])  # the other file, untouched
    more = _state(4, n=5000)
    more["b"]["extra"] = torch.ones(2, dtype=torch.int64)  # a new key too
    snaps.save(4, more)
    snaps.wait()
    assert snapshot_path(tmp_path, 1, 0, 4).stat().st_size > snapshot_path(tmp_path, 1, 0, 3).stat().st_size
    assert torch.equal(_loaded(tmp_path, 4)["b"]["extra"], more["b"]["extra"])
    three = _inode(tmp_path, 3)
    snaps.save(5, _state(5, n=5000))  # step 3's layout again: its file
    snaps.wait()
    assert _inode(tmp_path, 5) == three
    assert torch.equal(_loaded(tmp_path, 5)["w"], _state(5, n=5000)["w"]) and "extra" not in _loaded(tmp_path, 5)["b"]
    assert _steps(tmp_path) == [5, 4]
    snaps.close()


def test_an_earlier_workers_files_count_toward_keep_until_this_one_has_its_own(tmp_path):
    before = MemorySnapshots(tmp_path, rank=0, world_size=1)
    for step in (8, 9):
        before.save(step, _state(step))
        before.wait()
    before.close()
    snaps = MemorySnapshots(tmp_path, rank=0, world_size=1)
    snaps.save(10, _state(10))
    snaps.wait()
    assert _steps(tmp_path) == [10, 9]  # a step the restart's peers may all still have
    snaps.save(11, _state(11))
    snaps.wait()
    assert _steps(tmp_path) == [11, 10]
    snaps.close()


def test_no_room_for_a_file_turns_snapshots_off_when_it_is_made(tmp_path, monkeypatch, caplog):
    snaps = MemorySnapshots(tmp_path, rank=0, world_size=1)
    assert snaps.save(1, _state(1))
    snaps.wait()

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    assert not snaps.save(2, _state(2)) and not snaps.enabled
    assert [r for r in caplog.records if "memory snapshots are off" in r.message and "No space" in r.message]
    assert _steps(tmp_path) == [1] and rank_partials(tmp_path, 1, 0) == []
    snaps.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs of its own (as root), unmounted after the test."""
    mount = tmp_path / "shm"
    mount.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True,
                          text=True, timeout=30)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True, timeout=30, check=False)


def test_a_full_tmpfs_turns_snapshots_off_and_never_crashes_the_step(small_tmpfs):
    """Two 600 KB files do not fit in 1 MiB: the second is refused when it is made. Run in a child, so that a SIGBUS
    (a mapped page the tmpfs cannot supply) would show as its exit, not kill the test run."""
    script = textwrap.dedent(f"""
        import json, logging, torch
        import trainwarden.runtime.checkpoint.memory_snapshot as ms
        from trainwarden.agent.shared.snapshot_layout import snapshot_path
        logging.basicConfig(level=logging.WARNING)
        snaps = ms.MemorySnapshots({str(small_tmpfs)!r}, rank=0, world_size=1)
        state = {{"w": torch.ones(150_000)}}
        saved = []
        for step in (1, 2, 3):
            saved.append(snaps.save(step, state))
            snaps.wait()
        back = ms._load(snapshot_path({str(small_tmpfs)!r}, 1, 0, 1))["state"]["w"]
        print(json.dumps([saved, snaps.enabled, bool(back.eq(1).all())]))
        snaps.close()
    """)
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout) == [[True, False, False], False, True]
    assert "memory snapshots are off" in child.stderr and "No space left" in child.stderr
    assert _steps(small_tmpfs) == [1] and rank_partials(small_tmpfs, 1, 0) == []


def test_the_loader_refuses_a_file_of_another_rank_or_step_or_one_being_rewritten(tmp_path):
    snaps = MemorySnapshots(tmp_path, rank=0, world_size=2)
    snaps.save(2, _state(2))
    snaps.close()
    data = snapshot_path(tmp_path, 2, 0, 2).read_bytes()
    snapshot_path(tmp_path, 2, 1, 2).write_bytes(data)  # rank 0's file under rank 1's name
    snapshot_path(tmp_path, 2, 0, 7).write_bytes(data)  # step 2's under step 7's
    fresh = {"w": _Entry({"w": torch.zeros(1000)}), "b": _Entry({"m": torch.zeros(3, 4), "count": 0})}
    assert "holds step 2 of rank 0" in MemorySnapshots(tmp_path, rank=1, world_size=2).load(2, fresh)
    assert "holds step 2 of rank 0" in MemorySnapshots(tmp_path, rank=0, world_size=2).load(7, fresh)
    snapshot_path(tmp_path, 2, 0, 7).write_bytes(bytes(8) + data[8:])  # its magic cleared: being taken for reuse
    assert "being rewritten" in MemorySnapshots(tmp_path, rank=0, world_size=2).load(7, fresh)
    assert not fresh["w"].values["w"].any()  # nothing of the state changed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_state_on_a_gpu_and_the_cpu_round_trips():
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as root:
        snaps = MemorySnapshots(root, rank=0, world_size=1)
        state = {"gpu": torch.randn(1000, device="cuda"), "cpu": torch.randn(10), "n": 3}
        for step in (1, 2, 3):
            assert snaps.save(step, state)
            snaps.wait()
        back = _load(snapshot_path(root, 1, 0, 3))["state"]
        assert torch.equal(back["gpu"], state["gpu"].cpu()) and torch.equal(back["cpu"], state["cpu"])
        snaps.close()

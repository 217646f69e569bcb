"""Memory snapshots carry checksums and a restore verifies them (issue 48, item 1; runtime/checkpoint/memory_sums.py).

Real torchrun, gloo on CPU, FSDP2 (``ckpt_worker.py``), each simulated node a memory directory of its own. A byte of
one rank's snapshot flipped after it was written (the ``snapflip`` fault, or the test itself after the run) is found
by its sum when the job restores: the file is set aside, one incident names it, and the restore takes the next
source (the peer node's copy, an older step in memory, the disk), never the corrupt bytes.
"""

from __future__ import annotations

import shutil

import pytest

from integration.test_checkpoint import assert_same_state, load, torchrun
from trainwarden.runtime.checkpoint.memory_snapshot import MappedSnapshot

pytestmark = pytest.mark.integration

WORLD4 = "world-4"


def _restore(procs, base, nproc: int, node_map: str) -> tuple[dict, str]:
    log = torchrun(procs, nproc, base / "restore.log", "restore", "--dir", str(base / "ckpt"), "--dump-dir",
                   str(base), "--memory-root", str(base / "mem"), "--node-map", node_map)
    return load(base / "restored.pt"), log


@pytest.mark.timeout(300)
def test_a_flipped_byte_in_one_ranks_memory_snapshot_is_found_and_the_restore_takes_the_step_before(tmp_path, procs):
    """Two ranks snapshot every step, checkpoint every 2; rank 1's snapshot of step 5 loses a byte after it was
    written. The restore finds it, sets it aside with one incident, and resumes from step 4 (memory, whole), not
    from the corrupt step 5."""
    train_log = torchrun(procs, 2, tmp_path / "train.log", "train", "--dir", str(tmp_path / "ckpt"), "--dump-dir",
                         str(tmp_path), "--steps", "5", "--save-every", "2", "--memory-root", str(tmp_path / "mem"),
                         "--node-map", "0,0", "--faults", "snapflip:rank=1,step=5")
    assert "injecting fault snapflip:rank=1,step=5" in train_log, train_log[-3000:]
    restored, log = _restore(procs, tmp_path, 2, "0,0")
    corrupt = tmp_path / "mem" / "node-0" / "world-2" / "rank-00001.step-00000005.pt"
    assert restored["step"] == 4, log[-3000:]
    assert_same_state(load(tmp_path / "dump-4.pt"), restored)  # every byte of step 4, RNG states included
    heard = [line for line in log.splitlines() if "agent heard set_aside" in line]
    assert len(heard) == 1, log[-3000:]  # one incident
    assert f"path={corrupt} " in heard[0] and "rank 1's own copy of step 5" in heard[0], heard
    assert "buffer train/" in heard[0] and "xxh3_64" in heard[0] and "recorded" in heard[0], heard
    assert not corrupt.exists() and corrupt.with_name(corrupt.name + ".corrupt").is_file()  # kept, out of the way
    assert "resumed from the memory snapshot of step 4" in log, log[-3000:]


# trained_with_copies: tests/integration/conftest.py (one run shared with test_memory_reshard.py)


def _copy_and_flip(trained, tmp_path, node: int, name: str):
    shutil.copytree(trained / "ckpt", tmp_path / "ckpt")
    shutil.copytree(trained / "mem", tmp_path / "mem")
    path = tmp_path / "mem" / f"node-{node}" / WORLD4 / name
    snapshot = MappedSnapshot(path)
    # a weight or a moment, as the snapflip fault does (the RNG state, larger here, is not read by a resharded restore)
    _, _, offset, nbytes = max(snapshot.header["tensors"], key=lambda entry: ("float" in entry[0], entry[3]))
    snapshot.close()
    raw = bytearray(path.read_bytes())
    raw[offset + nbytes // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    return path


@pytest.mark.timeout(300)
def test_a_corrupt_own_snapshot_is_replaced_by_the_copy_the_peer_node_holds(trained_with_copies, tmp_path, procs):
    """Rank 2's own file of step 5 (node 1) is corrupt; node 0 holds a good copy of it: step 5 is restored from
    that copy through DCP, not from the disk's step 4 nor from the corrupt bytes."""
    trained, _ = trained_with_copies
    corrupt = _copy_and_flip(trained, tmp_path, 1, "rank-00002.step-00000005.pt")
    restored, log = _restore(procs, tmp_path, 4, "0,0,1,1")
    assert restored["step"] == 5, log[-3000:]
    assert_same_state(load(trained / "dump-5.pt"), restored, rng=False)  # not the corrupt bytes
    assert "resumed from the memory snapshots of step 5 taken at world size 4, now 4, resharded by DCP" in log
    heard = [line for line in log.splitlines() if "agent heard set_aside" in line]
    assert len(heard) == 1 and f"path={corrupt} " in heard[0] and "rank 2's own copy of step 5" in heard[0], heard


@pytest.mark.extended  # a second variant: the corrupt file is the peer's copy, found in the resharded restore
@pytest.mark.timeout(300)
def test_a_corrupt_peer_copy_of_a_lost_node_leaves_memory_for_the_disk(trained_with_copies, tmp_path, procs):
    """Node 1 is lost and node 0's copy of rank 2's step 5 is corrupt: no good copy of step 5 is left, step 4's
    files are all on node 0, and that step is restored (memory, resharded), never the corrupt bytes."""
    trained, _ = trained_with_copies
    corrupt = _copy_and_flip(trained, tmp_path, 0, "peer/rank-00002.step-00000005.pt")
    shutil.rmtree(tmp_path / "mem" / "node-1")
    restored, log = _restore(procs, tmp_path, 2, "0,0")
    assert restored["step"] == 4, log[-3000:]
    assert_same_state(load(trained / "dump-4.pt"), restored, rng=False)
    heard = [line for line in log.splitlines() if "agent heard set_aside" in line]
    assert len(heard) == 1 and f"path={corrupt} " in heard[0] and "rank 2's peer copy of step 5" in heard[0], heard

"""Restoring memory snapshots at another world size, or from files on other nodes (runtime/memory_reshard.py).

Real torchrun, gloo on CPU, FSDP2 (``ckpt_worker.py``). The training run is 4 ranks on two simulated nodes, each
node a memory directory of its own; it snapshots every step and checkpoints to disk every 2 steps, so after 5
steps the disk holds step 4 and memory step 5. The restoring run places its ranks on the nodes differently, so a
rank needs chunks only the other node holds: they cross in the Checkpointer's gloo group.
"""

from __future__ import annotations

import re
import shutil

import pytest

from integration.test_checkpoint import assert_same_state, load, torchrun

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def trained(tmp_path_factory, request):
    from procs import ProcessGroup

    base = tmp_path_factory.mktemp("memory-trained")
    procs = ProcessGroup()
    request.addfinalizer(procs.close)
    torchrun(procs, 4, base / "train.log", "train", "--dir", str(base / "ckpt"), "--dump-dir", str(base),
             "--steps", "5", "--save-every", "2", "--memory-root", str(base / "mem"), "--node-map", "0,0,1,1")
    return base


def _copy(trained, tmp_path):
    shutil.copytree(trained / "ckpt", tmp_path / "ckpt")
    shutil.copytree(trained / "mem", tmp_path / "mem")
    return tmp_path / "ckpt", tmp_path / "mem"


def _restore(procs, tmp_path, nproc: int, node_map: str) -> tuple[dict, str]:
    ckpt, mem = tmp_path / "ckpt", tmp_path / "mem"
    log = torchrun(procs, nproc, tmp_path / "restore.log", "restore", "--dir", str(ckpt), "--dump-dir",
                   str(tmp_path), "--memory-root", str(mem), "--node-map", node_map)
    return load(tmp_path / "restored.pt"), log


@pytest.mark.timeout(300)
def test_a_smaller_world_restores_the_newest_memory_step_resharded_across_nodes(trained, tmp_path, procs):
    _copy(trained, tmp_path)
    # new rank 0 on node 0 holds old ranks 0 and 1, which own rows new rank 1 needs, and the reverse: both cross
    restored, log = _restore(procs, tmp_path, 2, "1,0")
    assert restored["step"] == 5, log[-3000:]
    assert "resumed from the memory snapshots of step 5 taken at world size 4, now 2, resharded by DCP" in log
    crossed = re.search(r"\(([\d.]+) (KiB|MiB) crossed between nodes", log)
    assert crossed and float(crossed.group(1)) > 0, log[-3000:]  # each new rank needed the other node's chunks
    assert_same_state(load(trained / "dump-5.pt"), restored, rng=False)


@pytest.mark.timeout(300)
def test_the_same_world_numbered_anew_restores_from_the_other_nodes_files(trained, tmp_path, procs):
    _copy(trained, tmp_path)
    restored, log = _restore(procs, tmp_path, 4, "1,1,0,0")
    assert restored["step"] == 5, log[-3000:]
    assert "resumed from the memory snapshots of step 5 taken at world size 4, now 4, resharded by DCP" in log
    assert_same_state(load(trained / "dump-5.pt"), restored, rng=False)


@pytest.mark.timeout(300)
def test_a_missing_or_torn_file_leaves_memory_for_the_disk(trained, tmp_path, procs):
    _, mem = _copy(trained, tmp_path)
    # old rank 3's file of step 5 is gone: step 4 is the newest every rank has in memory, the disk's too
    (mem / "node-1" / "world-4" / "rank-00003.step-00000005.pt").unlink()
    torn = mem / "node-1" / "world-4" / "rank-00002.step-00000004.pt"
    torn.write_bytes(torn.read_bytes()[:-100])  # step 4's header cut short
    restored, log = _restore(procs, tmp_path, 2, "0,1")
    assert "not restoring step 4 from the memory snapshots taken at world size 4" in log, log[-3000:]
    assert "rank-00002.step-00000004.pt" in log and "torn" in log
    assert restored["step"] == 4
    assert_same_state(load(trained / "dump-4.pt"), restored, rng=False)
    assert torn.exists()  # nothing of the memory is removed by a failed restore

"""Restoring memory snapshots at another world size, or from files on other nodes (runtime/checkpoint/memory_reshard.py).

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


@pytest.mark.extended  # a second variant of the reshard restore (~30-45 s)
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


# trained_with_copies: tests/integration/conftest.py (one run shared with test_memory_sums.py)


@pytest.mark.timeout(300)
def test_a_lost_nodes_ranks_restore_from_the_copies_the_other_node_holds(trained_with_copies, tmp_path, procs):
    """Each rank sent its snapshots to the same local rank on the other node: with node 1's memory gone (the
    node is lost), node 0 alone holds every old rank's step 5, and the smaller world resumes from it, not from
    the disk's step 4."""
    trained, train_log = trained_with_copies
    _copy(trained, tmp_path)
    copies = sorted(p.name for p in (tmp_path / "mem" / "node-0" / "world-4" / "peer").iterdir())
    assert copies == ["rank-00002.step-00000004.pt", "rank-00002.step-00000005.pt", "rank-00003.step-00000004.pt",
                      "rank-00003.step-00000005.pt"], copies  # the two newest of each source, the close drained
    shutil.rmtree(tmp_path / "mem" / "node-1")
    restored, log = _restore(procs, tmp_path, 2, "0,0")
    assert restored["step"] == 5, log[-3000:]
    assert "resumed from the memory snapshots of step 5 taken at world size 4, now 2, resharded by DCP" in log
    assert_same_state(load(trained / "dump-5.pt"), restored, rng=False)
    assert "stops copying" not in train_log


@pytest.mark.extended  # a second variant of restoring from the peer copies (~30-40 s)
@pytest.mark.timeout(300)
def test_a_rank_whose_own_file_is_only_a_peer_copy_loads_it_at_the_same_world(trained_with_copies, tmp_path, procs):
    """Node 1 replaced: the four ranks again, old ranks 2 and 3 now on node 0 with the copies of their files."""
    trained, _ = trained_with_copies
    _copy(trained, tmp_path)
    shutil.rmtree(tmp_path / "mem" / "node-1")
    restored, log = _restore(procs, tmp_path, 4, "0,0,0,0")
    assert restored["step"] == 5, log[-3000:]
    assert "resumed from the memory snapshot of step 5 " in log  # each rank its own file (two of them copies)
    assert_same_state(load(trained / "dump-5.pt"), restored)  # RNG states too: each rank's own file


@pytest.mark.timeout(300)
def test_a_script_that_never_closes_its_checkpointer_still_ends_cleanly(tmp_path, procs):
    """With the copies running, a script that destroys its process groups and ends without closing the
    Checkpointer: no rank may be left in a gloo wait (the process would abort at exit)."""
    log = torchrun(procs, 4, tmp_path / "train.log", "train", "--dir", str(tmp_path / "ckpt"), "--dump-dir",
                   str(tmp_path), "--steps", "4", "--save-every", "2", "--memory-root", str(tmp_path / "mem"),
                   "--node-map", "0,0,1,1", "--per-node", "2", "--no-close")
    assert log.count("done mode=train") == 4 and "SIGABRT" not in log, log[-3000:]
    assert list((tmp_path / "mem" / "node-0" / "world-4" / "peer").glob("rank-*.pt"))

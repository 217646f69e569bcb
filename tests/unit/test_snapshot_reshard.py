"""Memory snapshots read through DCP (runtime/checkpoint/memory_reshard.py): which step the ranks take, what the agent vouches
for across ranks, and a snapshot loaded by ``dcp.load`` through ``SnapshotReader`` in one process.

The several-process cases (another world size, files on another node, the exchange between nodes) run real
torchrun workers: tests/integration/test_memory_reshard.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainwarden.agent.launch.memory_tier import MemoryTier
from trainwarden.agent.shared.snapshot_layout import peer_path, snapshot_path
from trainwarden.runtime.checkpoint import ModelState
from trainwarden.runtime.checkpoint.memory_reshard import SnapshotReader, choose, metadata, open_files
from trainwarden.runtime.checkpoint.memory_snapshot import MemorySnapshots

pytestmark = pytest.mark.timeout(120)


# ---- the choice -------------------------------------------------------------------------------------------------


def test_the_newest_step_of_which_every_old_rank_has_a_file_somewhere_is_taken():
    # two nodes of a 4-rank world; now 2 ranks, one per node: each node holds its two old ranks' files
    held = [[(4, 0, 7), (4, 1, 7), (4, 0, 6), (4, 1, 6)], [(4, 2, 7), (4, 3, 6), (4, 2, 6)]]
    choice = choose(held, world_size=2, floor=0)
    assert (choice.world, choice.step, choice.own) == (4, 6, False)  # rank 3 has no step 7
    assert choice.holders == {0: 0, 1: 0, 2: 1, 3: 1}
    assert choose(held, world_size=2, floor=7) is None  # never older than the disk or etcd's committed step


def test_every_rank_holding_its_own_file_loads_its_own_and_a_tie_prefers_the_current_world():
    held = [[(2, 0, 5), (2, 1, 5), (4, 0, 5), (4, 1, 5), (4, 2, 5), (4, 3, 5)], [(2, 1, 5)]]
    choice = choose(held, world_size=2, floor=0)
    assert (choice.world, choice.step, choice.own, choice.holders) == (2, 5, True, {0: 0, 1: 0})
    # the same files, rank 1's node holding none of its own: not its own, so through DCP
    choice = choose([held[0], []], world_size=2, floor=0)
    assert (choice.world, choice.own, choice.holders) == (2, False, {0: 0, 1: 0})


def test_nothing_to_choose_and_nonsense_is_ignored():
    assert choose([[], []], world_size=2, floor=0) is None
    assert choose([[(2, 5, 3), (2, 0, 3)]], world_size=1, floor=0) is None  # rank 5 of 2 is no rank


# ---- the agent vouches for every rank of its node ------------------------------------------------------------------


def test_the_agent_tells_every_file_it_vouches_for_on_its_node(tmp_path):
    tier = MemoryTier.open("j", root=tmp_path)
    assert tier.held("j") == []
    for rank, step in ((0, 4), (0, 5), (0, 6), (1, 5)):
        tier.on_checkpoint("j", rank, "snapshot", step, str(snapshot_path(tier.path, 2, rank, step)), 0)
    assert sorted(tier.held("j")) == [(2, 0, 5), (2, 0, 6), (2, 1, 5)]  # KEEP: a rank's newest two
    assert tier.held("other") == []
    tier.close()


def test_the_agent_vouches_for_the_copies_its_ranks_received_of_another_nodes_ranks(tmp_path):
    """Ranks 0 and 1 live here; rank 0 received copies of rank 2's files, rank 1 of rank 3's (runtime/checkpoint/memory_peer.py)."""
    tier = MemoryTier.open("j", root=tmp_path)
    for receiver, owner, step in ((0, 2, 4), (0, 2, 5), (0, 2, 6), (1, 3, 6)):
        tier.on_checkpoint("j", receiver, "snapshot", step, str(peer_path(tier.path, 4, owner, step)), 0)
    tier.on_checkpoint("j", 0, "snapshot", 6, str(snapshot_path(tier.path, 4, 0, 6)), 0)
    assert sorted(tier.held("j")) == [(4, 0, 6), (4, 2, 5), (4, 2, 6), (4, 3, 6)]
    assert tier.steps("j", 4, 2) == []  # a copy is not the asking rank's own snapshot
    # refused: a copy outside its directory, of the reporting rank itself, of another step than its name
    tier.on_checkpoint("j", 1, "snapshot", 7, str(peer_path(tmp_path / "elsewhere", 4, 3, 7)), 0)
    tier.on_checkpoint("j", 3, "snapshot", 7, str(peer_path(tier.path, 4, 3, 7)), 0)
    tier.on_checkpoint("j", 1, "snapshot", 8, str(peer_path(tier.path, 4, 3, 7)), 0)
    assert (4, 3, 7) not in tier.held("j")
    tier.close()


def test_a_file_being_sent_to_the_peer_node_is_never_taken_by_a_snapshot(tmp_path):
    _, _, state = _job(0)
    snaps = MemorySnapshots(tmp_path, rank=0, world_size=1)
    sent = []
    snaps.on_written = lambda step, file: sent.append(file)
    for step in (1, 2):
        assert snaps.save(step, state)
        snaps.wait()
    sent[0].pinned = True  # step 1's file, the oldest: the sender has it
    assert not snaps.save(3, state) and snaps.skipped == 1
    assert snapshot_path(tmp_path, 1, 0, 1).is_file()
    sent[0].pinned = False
    assert snaps.save(3, state)
    snaps.wait()
    snaps.close()
    assert not snapshot_path(tmp_path, 1, 0, 1).exists() and snapshot_path(tmp_path, 1, 0, 3).is_file()


# ---- DCP reads a snapshot -------------------------------------------------------------------------------------------


def _job(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 6)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer, {"train": ModelState(model, optimizer), "extra": {"epoch": 3, "seen": [1, 2]}}


def test_dcp_loads_a_snapshot_through_the_reader_exactly(tmp_path):
    model, optimizer, state = _job(0)
    snaps = MemorySnapshots(tmp_path, rank=0, world_size=1)
    assert snaps.save(9, state)
    snaps.wait()
    snaps.close()
    mapped, errors = open_files({0: snapshot_path(tmp_path, 1, 0, 9)}, 9, 1)
    assert errors == {}
    fresh_model, fresh_optimizer, fresh = _job(1)
    fresh["extra"] = {"epoch": 0, "seen": []}
    dcp.load(fresh, storage_reader=SnapshotReader({0: mapped[0].header}, mapped, {0: 0}, rank=0), no_dist=True)
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(optimizer.state.values(), fresh_optimizer.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    assert fresh["extra"] == {"epoch": 3, "seen": [1, 2]}


def test_a_file_of_another_step_or_rank_or_without_a_dcp_view_is_refused(tmp_path):
    _, _, state = _job(0)
    snaps = MemorySnapshots(tmp_path, rank=0, world_size=1)
    snaps.save(9, state)
    snaps.wait()
    snaps.close()
    path = snapshot_path(tmp_path, 1, 0, 9)
    _, errors = open_files({0: path}, 8, 1)
    assert "holds step 9 of rank 0 at world size 1" in errors[0]
    _, errors = open_files({3: path}, 9, 4)
    assert "holds step 9 of rank 0 at world size 1" in errors[3]
    mapped, _ = open_files({0: path}, 9, 1)
    header = dict(mapped[0].header, dcp=None)  # what a file of an older trainwarden holds
    with pytest.raises(ValueError, match="records no DCP view"):
        metadata({0: header})
    torn = tmp_path / "torn.pt"
    torn.write_bytes(path.read_bytes()[:-50])
    _, errors = open_files({0: torn}, 9, 1)
    assert "torn" in errors[0]

"""Per-step memory snapshots (issue 26 item 3): the rank's side (runtime/checkpoint/memory_snapshot.py), the agent's record
(agent/launch/memory_tier.py) and the Checkpointer's choice between memory and disk (runtime/checkpoint/checkpointer.py).

Real tensors, a real optimizer and real files in a temporary directory; the node agent is a small fake session
that answers what the CheckpointRecord RPC would (the integration test runs the real one:
tests/integration/test_gpt.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from trainwarden.agent.launch.memory_tier import MemoryTier
from trainwarden.agent.shared.snapshot_layout import parse_snapshot, rank_snapshots, snapshot_path
from trainwarden.runtime.checkpoint import Checkpointer, RNGState
from trainwarden.runtime.examples.gpt import TrainState
from trainwarden.runtime.checkpoint.memory_snapshot import MemorySnapshots

pytestmark = pytest.mark.timeout(120)


def _job(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainState(model, optimizer)
    return model, optimizer, {"app": state, "rng": RNGState()}


def _train(model, optimizer, state, step: int) -> None:
    torch.manual_seed(1000 + step)
    model(torch.randn(3, 6)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    state["app"].step = step


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


class _Agent:
    """What the node agent answers a restoring rank: etcd's record of the disk checkpoint and the steps of the
    rank's memory snapshots it holds."""

    def __init__(self, record: int | None = None, memory: list[int] = ()) -> None:
        self.record, self.memory = record, list(memory)
        self.stages: list[tuple[str, int, str]] = []

    def committed_record(self):
        return self.record, "", "found" if self.record is not None else "none recorded"

    def memory_steps(self, world_size: int):
        return self.memory

    def checkpoint_event(self, stage, step, seconds=0.0, bytes=0, path="", detail=""):
        self.stages.append((stage, step, path))

    def commit_refusal(self, step, path="", bytes=0):
        return None


def test_a_snapshot_loads_back_into_a_fresh_model_and_optimizer_exactly(tmp_path):
    model, optimizer, state = _job()
    reported = []
    snaps = MemorySnapshots(tmp_path, rank=0, world_size=1, report=lambda *a: reported.append(a))
    for step in (1, 2, 3):
        _train(model, optimizer, state, step)
        assert snaps.save(step, state)
        snaps.wait()
    assert [r[0] for r in reported] == [1, 2, 3] and parse_snapshot(reported[-1][1]) == (1, 0, 3)
    assert [s for s, _ in rank_snapshots(tmp_path, 1, 0)] == [3, 2]  # KEEP: the newest two
    weights = _params(model)
    moments = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    random_next = torch.rand(3)

    fresh_model, fresh_optimizer, fresh_state = _job(seed=7)  # other weights, no optimizer state yet
    torch.rand(5)  # and the generator elsewhere
    assert MemorySnapshots(tmp_path, rank=0, world_size=1).load(3, fresh_state) == ""
    assert all(torch.equal(a, b) for a, b in zip(weights, fresh_model.parameters()))
    assert torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg"], moments)
    assert fresh_state["app"].step == 3
    assert torch.equal(torch.rand(3), random_next)  # the RNG state came back with it
    snaps.close()


def test_what_does_not_match_is_an_error_and_nothing_else(tmp_path):
    model, optimizer, state = _job()
    _train(model, optimizer, state, 1)
    snaps = MemorySnapshots(tmp_path, rank=0, world_size=1)
    snaps.save(1, state)
    snaps.wait()
    other = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    wrong = {"app": TrainState(other, torch.optim.AdamW(other.parameters())), "rng": RNGState()}
    assert "does not match the state" in snaps.load(1, wrong)
    assert "no snapshot of step 2" in snaps.load(2, state)
    assert "has no snapshot" in MemorySnapshots(tmp_path, rank=1, world_size=1).load(1, state)
    assert "no snapshot" in MemorySnapshots(tmp_path, rank=0, world_size=2).load(1, state)  # another world size
    snapshot_path(tmp_path, 1, 0, 1).write_bytes(b"torn")
    assert "cannot be read" in snaps.load(1, state)
    snaps.close()


def test_the_step_never_waits_for_a_write_it_skips_while_one_is_in_flight(tmp_path):
    model, optimizer, state = _job()
    release = threading.Event()
    snaps = MemorySnapshots(tmp_path, rank=0, world_size=1, report=lambda *a: release.wait(30))
    assert snaps.save(1, state)
    assert not snaps.save(2, state) and snaps.skipped == 1  # the first one is still being written
    release.set()
    snaps.wait()
    assert snaps.save(3, state)
    snaps.wait()
    assert [s for s, _ in rank_snapshots(tmp_path, 1, 0)] == [3, 1]
    snaps.close()


def test_a_write_that_fails_turns_snapshots_off_with_one_warning_and_never_raises(tmp_path, caplog):
    model, optimizer, state = _job()
    blocker = tmp_path / "world-1"
    blocker.write_text("a file where the directory should be")  # as a full /dev/shm would fail the write
    snaps = MemorySnapshots(tmp_path, rank=0, world_size=1)
    snaps.save(1, state)  # the file is made in the call: the failure is there, never raised
    snaps.wait()
    assert not snaps.enabled and not snaps.save(2, state)
    assert [r.message for r in caplog.records if "memory snapshots are off" in r.message]
    snaps.close()


# ---- the agent's record -----------------------------------------------------------------------------------


def _report(tier: MemoryTier, rank: int, step: int, world: int = 2, job: str = "j") -> None:
    tier.on_checkpoint(job, rank, "snapshot", step, str(snapshot_path(tier.path, world, rank, step)), 0)


def test_the_agent_answers_for_each_rank_the_steps_it_reported_and_still_keeps(tmp_path):
    tier = MemoryTier.open("j", root=tmp_path)
    assert tier.env() == {"TRAINWARDEN_MEMORY_DIR": str(tier.path)}
    assert tier.steps("j", 2, 0) == []
    for step in (4, 5, 6):
        _report(tier, 0, step)
    _report(tier, 1, 5)
    assert tier.steps("j", 2, 0) == [6, 5] and tier.steps("j", 2, 1) == [5]  # KEEP: a rank's newest two
    assert tier.steps("j", 4, 0) == [] and tier.steps("other", 2, 0) == []
    tier.on_checkpoint("j", 1, "snapshot", 8, str(snapshot_path(tmp_path / "elsewhere", 2, 1, 8)), 0)
    tier.on_checkpoint("j", 1, "snapshot", 8, str(snapshot_path(tier.path, 2, 0, 8)), 0)  # rank 0's file
    tier.on_checkpoint("j", 1, "snapshot", 9, str(snapshot_path(tier.path, 2, 1, 8)), 0)  # another step's
    assert tier.steps("j", 2, 1) == [5]  # none of them counted
    (tier.path / "world-2").mkdir()
    _report(tier, 0, 9, world=1)  # a round of another size: the old world's files go
    assert tier.steps("j", 2, 0) == [] and tier.steps("j", 1, 0) == [9] and not (tier.path / "world-2").exists()
    tier.close()
    assert not tier.path.exists()


def test_an_agent_that_restarts_drops_the_snapshots_of_the_one_before(tmp_path):
    """A run SIGKILLed with snapshots in memory: the next run's tier removes them and knows no step."""
    child = subprocess.run([sys.executable, "-c",
                            "import os, signal\n"
                            "from pathlib import Path\n"
                            "from trainwarden.agent.launch.memory_tier import MemoryTier\n"
                            "from trainwarden.agent.shared.snapshot_layout import snapshot_path\n"
                            f"tier = MemoryTier.open('j', root=Path({str(tmp_path)!r}))\n"
                            "p = snapshot_path(tier.path, 1, 0, 3); p.parent.mkdir(); p.write_bytes(b'x')\n"
                            "print(tier.path, flush=True)\n"
                            "os.kill(os.getpid(), signal.SIGKILL)"], capture_output=True, text=True, timeout=60)
    assert child.returncode == -9, child.stderr
    left = tmp_path / os.path.basename(child.stdout.strip())
    assert snapshot_path(left, 1, 0, 3).is_file()
    tier = MemoryTier.open("j", root=tmp_path)
    assert not left.exists() and tier.steps("j", 1, 0) == []
    tier.close()


# ---- the Checkpointer: memory first, never older than the disk ------------------------------------------------


def _snapshotted_and_saved(tmp_path, *, snapshot_until: int, save_at: int):
    model, optimizer, state = _job()
    agent = _Agent()
    ckpt = Checkpointer(tmp_path / "ckpt", session=agent, memory_dir=tmp_path / "mem", read_backoff_s=())
    weights = {}
    for step in range(1, max(snapshot_until, save_at) + 1):
        _train(model, optimizer, state, step)
        weights[step] = _params(model)
        if step <= snapshot_until:
            assert ckpt.snapshot(step, state)
            ckpt.memory.wait()
        if step == save_at:
            ckpt.save(step, state)
            ckpt.wait()
    ckpt.close()
    return weights, agent


def _restore(tmp_path, agent):
    model, optimizer, state = _job(seed=3)
    ckpt = Checkpointer(tmp_path / "ckpt", session=agent, memory_dir=tmp_path / "mem", read_backoff_s=())
    step = ckpt.restore(state)
    ckpt.close()
    return step, model, ckpt


def test_restore_takes_the_memory_snapshot_when_it_is_newer_than_the_disk(tmp_path):
    weights, agent = _snapshotted_and_saved(tmp_path, snapshot_until=7, save_at=5)
    agent.record, agent.memory = 5, [7, 6]
    step, model, ckpt = _restore(tmp_path, agent)
    assert step == 7 and ckpt.resumed_from_memory
    assert all(torch.equal(a, b) for a, b in zip(weights[7], model.parameters()))
    assert ("restored", 7, str(tmp_path / "mem")) in agent.stages


def test_a_snapshot_older_than_the_committed_disk_checkpoint_is_never_used(tmp_path):
    """The disk committed a newer step than memory holds (a save the snapshots did not see): the disk wins."""
    weights, agent = _snapshotted_and_saved(tmp_path, snapshot_until=4, save_at=6)
    agent.record, agent.memory = 6, [4, 3]
    step, model, ckpt = _restore(tmp_path, agent)
    assert step == 6 and not ckpt.resumed_from_memory
    assert all(torch.equal(a, b) for a, b in zip(weights[6], model.parameters()))


def test_a_snapshot_the_agent_does_not_vouch_for_is_never_used(tmp_path):
    """Files in memory but no record in the agent (it restarted, or a rank never reported): the disk."""
    weights, agent = _snapshotted_and_saved(tmp_path, snapshot_until=7, save_at=5)
    agent.record, agent.memory = 5, []
    step, model, ckpt = _restore(tmp_path, agent)
    assert step == 5 and not ckpt.resumed_from_memory
    assert all(torch.equal(a, b) for a, b in zip(weights[5], model.parameters()))


def test_a_step_the_agent_vouches_for_whose_file_is_gone_is_not_counted(tmp_path):
    weights, agent = _snapshotted_and_saved(tmp_path, snapshot_until=7, save_at=5)
    snapshot_path(tmp_path / "mem", 1, 0, 7).unlink()
    agent.record, agent.memory = 5, [7, 6]
    step, model, ckpt = _restore(tmp_path, agent)
    assert step == 6 and ckpt.resumed_from_memory
    assert all(torch.equal(a, b) for a, b in zip(weights[6], model.parameters()))


def test_a_snapshot_that_fails_to_load_falls_back_to_the_disk(tmp_path):
    weights, agent = _snapshotted_and_saved(tmp_path, snapshot_until=7, save_at=5)
    snapshot_path(tmp_path / "mem", 1, 0, 7).write_bytes(b"torn")
    agent.record, agent.memory = 5, [7, 6]
    step, model, ckpt = _restore(tmp_path, agent)
    assert step == 5 and not ckpt.resumed_from_memory
    assert all(torch.equal(a, b) for a, b in zip(weights[5], model.parameters()))


def test_the_file_format_round_trips_every_dtype_and_refuses_what_is_not_a_snapshot(tmp_path):
    import pickle

    from trainwarden.runtime.checkpoint.memory_snapshot import _MAGIC, _PREFIX, _load

    state = {"a": torch.arange(5, dtype=torch.bfloat16), "b": torch.tensor(3.5), "c": torch.empty(0, 4),
             "d": torch.tensor([True, False]), "e": {"f": [torch.ones(2, 3, dtype=torch.int64), 7, "x", None]},
             "g": (1, (2, 3), 4.5), "h": torch.arange(12.0).reshape(3, 4).t()}  # not contiguous
    snaps = MemorySnapshots(tmp_path, rank=0, world_size=1)
    assert snaps.save(1, {"s": state})
    snaps.close()
    path = snapshot_path(tmp_path, 1, 0, 1)
    back = _load(path)["state"]["s"]
    for key in ("a", "b", "c", "d", "h"):
        assert back[key].dtype == state[key].dtype and torch.equal(back[key], state[key]), key
    assert torch.equal(back["e"]["f"][0], state["e"]["f"][0]) and back["e"]["f"][1:] == [7, "x", None]
    assert back["g"] == (1, (2, 3), 4.5)
    back["a"] += 1  # the loaded tensors own their memory
    assert torch.equal(_load(path)["state"]["s"]["a"], state["a"])
    torn = tmp_path / "torn.pt"
    torn.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ValueError, match="torn"):
        _load(torn)
    hostile = tmp_path / "hostile.pt"
    header = pickle.dumps({"body": os.system, "tensors": []})  # a class (a callable) in the header
    hostile.write_bytes(_PREFIX.pack(_MAGIC, 0, _PREFIX.size, len(header)) + header)
    with pytest.raises(pickle.UnpicklingError):
        _load(hostile)
    (tmp_path / "other.pt").write_bytes(b"PK\x03\x04 a zip")
    with pytest.raises(ValueError, match="magic"):
        _load(tmp_path / "other.pt")


@pytest.mark.parametrize("source", ["memory", "disk"])
def test_a_plain_dict_or_list_entry_comes_back_from_memory_as_from_disk(tmp_path, source):
    """Entries that are not Stateful (a dict of counters, a list, a number) come back the same from memory and from
    disk, into the objects the job holds. The memory path skipped them in silence (the data position of a job
    resumed from memory started over), and the disk path gave the state mapping a new list and number but left
    the job's own list as it was."""
    model, optimizer, state = _job()
    ckpt = Checkpointer(tmp_path / "ckpt", session=_Agent(), memory_dir=tmp_path / "mem", read_backoff_s=())
    extra, seen = {"epoch": 0, "position": torch.zeros(2)}, []
    state.update(extra=extra, seen=seen, tokens=0)
    for step in (1, 2, 3):
        _train(model, optimizer, state, step)
        extra["epoch"], extra["position"] = step, torch.full((2,), float(step))
        seen.append(step)
        state["tokens"] = 100 * step
        assert ckpt.snapshot(step, state)
        ckpt.memory.wait()
        if step == 3:
            ckpt.save(step, state)
            ckpt.wait()
    ckpt.close()
    agent = _Agent(record=3, memory=[3, 2] if source == "memory" else [])
    model, optimizer, fresh = _job(seed=3)
    fresh_extra, fresh_seen = {"epoch": -1, "position": torch.zeros(2)}, [0, 0, 0]
    fresh.update(extra=fresh_extra, seen=fresh_seen, tokens=0)
    restorer = Checkpointer(tmp_path / "ckpt", session=agent, memory_dir=tmp_path / "mem", read_backoff_s=())
    assert restorer.restore(fresh) == 3 and restorer.resumed_from_memory == (source == "memory")
    restorer.close()
    assert fresh["extra"] is fresh_extra and fresh_extra["epoch"] == 3
    assert torch.equal(fresh_extra["position"], torch.full((2,), 3.0))
    assert fresh["seen"] is fresh_seen and fresh_seen == [1, 2, 3]
    assert fresh["tokens"] == 300

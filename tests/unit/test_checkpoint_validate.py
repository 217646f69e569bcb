"""Checkpoint completeness, the ``latest`` pointer, retention choice, and a single-process Checkpointer."""

from __future__ import annotations

import json
import logging
import os
import random
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainwarden.agent.shared import checkpoint_aside as asides
from trainwarden.agent.shared import checkpoint_layout as store
from trainwarden.runtime.checkpoint import (
    CheckpointInfo,
    CheckpointNotFoundError,
    Checkpointer,
    RNGState,
    find_complete,
    validate,
)

pytestmark = pytest.mark.timeout(60)


def make_checkpoint(directory: Path, step: int, value: float = 1.0) -> Path:
    path = store.step_dir(directory, step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"w": torch.full((64,), value), "b": torch.arange(8.0)}, checkpoint_id=str(path), no_dist=True)
    return path


def data_file(path: Path) -> Path:
    (f,) = path.glob("*.distcp")
    return f


def test_complete_checkpoint_has_no_problems(tmp_path):
    assert validate(make_checkpoint(tmp_path, 5)) == []


def test_missing_metadata(tmp_path):
    path = make_checkpoint(tmp_path, 5)
    (path / ".metadata").unlink()
    (problem,) = validate(path)
    assert "no .metadata" in problem and str(path) in problem


def test_missing_data_file(tmp_path):
    path = make_checkpoint(tmp_path, 5)
    data_file(path).unlink()
    (problem,) = validate(path)
    assert "missing data file __0_0.distcp" in problem


def test_truncated_data_file(tmp_path):
    path = make_checkpoint(tmp_path, 5)
    f = data_file(path)
    f.write_bytes(f.read_bytes()[:-1])
    (problem,) = validate(path)
    assert "truncated data file __0_0.distcp" in problem


def test_garbage_metadata(tmp_path):
    path = make_checkpoint(tmp_path, 5)
    (path / ".metadata").write_bytes(b"\x00not a pickle")
    (problem,) = validate(path)
    assert "unreadable .metadata" in problem


def test_not_a_directory(tmp_path):
    assert "is not a directory" in validate(tmp_path / "nope")[0]


def test_missing_rng_sidecar_for_saved_world_size(tmp_path):
    path = make_checkpoint(tmp_path, 5)
    (path / store.MANIFEST_NAME).write_text(json.dumps({"step": 5, "world_size": 2, "rng_keys": ["rng"]}))
    (path / "rng-rank0.pt").write_bytes(b"x")
    (problem,) = validate(path)
    assert "rng-rank1.pt" in problem and "world size 2" in problem


def test_find_complete_newest_first_skipping_incomplete(tmp_path):
    for step in (2, 4, 6):
        make_checkpoint(tmp_path, step)
    (store.step_dir(tmp_path, 6) / ".metadata").unlink()
    (tmp_path / "step-00000008.unloadable").mkdir()
    (tmp_path / "notes").mkdir()
    infos = find_complete(tmp_path)
    assert [i.step for i in infos] == [4, 2]
    assert infos[0].bytes == sum(p.stat().st_size for p in store.step_dir(tmp_path, 4).iterdir())
    assert [s.step for s in store.scan(tmp_path)] == [6, 4, 2]


def test_pointer_round_trip(tmp_path):
    info = CheckpointInfo(step=7, path="/x/step-00000007", time=1.5, bytes=10)
    store.write_latest(tmp_path, info)
    assert store.read_latest(tmp_path) == info
    assert json.loads((tmp_path / "latest").read_text()) == {"step": 7, "path": "/x/step-00000007",
                                                             "time": 1.5, "bytes": 10}


def test_pointer_write_is_atomic(tmp_path, monkeypatch):
    old = CheckpointInfo(step=1, path="/a", time=1.0, bytes=1)
    store.write_latest(tmp_path, old)

    def crash(src, dst):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(store.os, "replace", crash)
    with pytest.raises(OSError):
        store.write_latest(tmp_path, CheckpointInfo(step=2, path="/b", time=2.0, bytes=2))
    monkeypatch.undo()
    assert store.read_latest(tmp_path) == old
    assert sorted(os.listdir(tmp_path)) == ["latest"]  # no temporary file left behind


def test_unreadable_pointer_is_ignored(tmp_path, caplog):
    (tmp_path / "latest").write_text('{"step": 3, "path": "/p"')
    with caplog.at_level(logging.WARNING):
        assert store.read_latest(tmp_path) is None
    assert "unreadable checkpoint pointer" in caplog.text
    (tmp_path / "latest").write_text('{"step": 3, "path": "/p", "time": 1, "bytes": 2, "extra": 1}')
    assert store.read_latest(tmp_path) is None
    assert store.read_latest(tmp_path / "absent") is None


C, U, R, X = store.COMPLETE, store.UNFINISHED, store.UNREADABLE, store.CORRUPT


@pytest.mark.parametrize("entries, keep, doomed", [
    ([(10, C), (8, C), (6, C), (4, U), (12, U)], 2, [4, 6]),  # newer unfinished: maybe a save in flight
    ([(10, C), (8, C)], 3, []),
    ([(10, U), (8, U)], 1, []),                               # nothing complete: delete nothing
    ([(10, C), (8, C), (6, C)], 1, [6, 8]),                   # newest complete always kept
    ([(3, U), (5, C), (1, C)], 5, [3]),                       # a save that never finished, below the newest
    # what might be the only good copy is never deleted: unreadable here (EIO, permissions, another torch's
    # metadata) or corrupt, old or new
    ([(12, R), (10, C), (8, X), (6, R), (4, C)], 1, [4]),
    ([(10, R), (8, R)], 1, []),
])
def test_choose_deletions(entries, keep, doomed):
    assert store.choose_deletions(entries, keep) == doomed


def test_choose_deletions_rejects_keep_zero():
    with pytest.raises(ValueError, match="keep must be >= 1"):
        store.choose_deletions([(1, store.COMPLETE)], 0)


class Box:
    """A Stateful holding one tensor and one int."""

    def __init__(self) -> None:
        self.w = torch.zeros(16)
        self.n = 0

    def state_dict(self):
        return {"w": self.w, "n": self.n}

    def load_state_dict(self, sd):
        self.w.copy_(sd["w"])
        self.n = sd["n"]


def test_single_process_save_restore_retention_and_commit_hook(tmp_path):
    committed: list[CheckpointInfo] = []
    box = Box()
    state = {"box": box, "rng": RNGState()}
    with Checkpointer(tmp_path, keep=2, on_commit=committed.append) as ckpt:
        for step in (1, 2, 3):
            box.w.fill_(step)
            box.n = step
            ckpt.save(step, state)
            box.w.fill_(-1)  # mutating after save() returns must not affect what is written
        ckpt.save(3, state)  # the same step again (an on-demand save at a scheduled step) is a no-op
        ckpt.wait()
        expected_draw = (torch.rand(3), random.random())
        assert [c.step for c in committed] == [1, 2, 3]
        assert store.read_latest(tmp_path).step == 3
        assert [i.step for i in find_complete(tmp_path)] == [3, 2]
        box.n = 0
        torch.manual_seed(1234)
        assert ckpt.restore(state) == 3
    assert box.n == 3 and torch.equal(box.w, torch.full((16,), 3.0))
    assert torch.equal(expected_draw[0], torch.rand(3)) and expected_draw[1] == random.random()


def test_failed_save_and_failing_hook_do_not_raise(tmp_path, caplog):
    def bad_hook(info):
        raise RuntimeError("etcd down")

    (tmp_path / "step-00000001").write_text("a file where the checkpoint directory should go")
    with caplog.at_level(logging.ERROR), Checkpointer(tmp_path, on_commit=bad_hook) as ckpt:
        ckpt.save(1, {"box": Box()})
        assert ckpt.wait() is None
        assert ckpt.failed_saves == 1 and ckpt.last_error is not None
        ckpt.save(2, {"box": Box()})
        assert ckpt.wait().step == 2
    assert "checkpoint save of step 1" in caplog.text and "on_commit callback failed" in caplog.text


def test_restore_without_checkpoint(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore({"box": Box()}) is None
        with pytest.raises(CheckpointNotFoundError, match=str(tmp_path)):
            ckpt.restore({"box": Box()}, require=True)


def test_next_save_does_not_wait_for_a_slow_on_commit(tmp_path):
    """Publishing to etcd runs after the commit; a slow etcd must not stall the next checkpointing step."""
    import threading

    release, hook_done, steps = threading.Event(), threading.Event(), []

    def slow_hook(info):
        steps.append(info.step)
        release.wait(10)  # etcd unreachable: the publisher's timeout
        hook_done.set()

    state = {"box": Box()}
    with Checkpointer(tmp_path, on_commit=slow_hook) as ckpt:
        ckpt.save(1, state)
        ckpt.save(2, state)  # waits for step 1 to be committed, not for its hook
        assert not hook_done.is_set()
        release.set()
        assert ckpt.wait().step == 2
    assert steps == [1, 2]


class _FencingSession:
    """The runtime session's checkpoint side, with the node agent's commit answer scripted."""

    def __init__(self, refusals):
        self.refusals, self.events, self.asked = list(refusals), [], []

    def checkpoint_event(self, stage, step, seconds=0.0, bytes=0, path="", detail=""):
        self.events.append((stage, step, detail))

    def commit_refusal(self, step, path, bytes):
        self.asked.append(step)
        return self.refusals.pop(0)


def test_a_checkpoint_the_agent_refuses_to_commit_is_set_aside_and_never_restored(tmp_path):
    """A node left in an older round (fenced) may finish writing a checkpoint; it must not become the job's
    latest, nor be what the next restore picks. It is set aside whole, with the reason."""
    session = _FencingSession([None, "the job's current round is round 4 of generation 0 and this worker's is "
                                     "round 3 of generation 0: it was left behind", None])
    box = Box()
    state = {"box": box}
    with Checkpointer(tmp_path, session=session) as ckpt:
        box.n = 1
        ckpt.save(1, state)
        ckpt.wait()
        box.n = 2
        ckpt.save(2, state)
        assert ckpt.wait() is None
        assert session.asked == [1, 2]
        assert store.read_latest(tmp_path).step == 1
        fenced = tmp_path / "step-00000002.fenced"
        assert fenced.is_dir() and "left behind" in json.loads((fenced / asides.QUARANTINE_NOTE).read_text())["reason"]
        assert ("failed", 2) in [(stage, step) for stage, step, _ in session.events]
        assert any(d.startswith("fenced: ") for _, _, d in session.events)
        box.n = 0
        assert ckpt.restore(state) == 1
        assert box.n == 1
        box.n = 3  # a commit of a newer step: retention may now remove the fenced copy, as an unfinished one
        ckpt.save(3, state)
        ckpt.wait()
        assert store.read_latest(tmp_path).step == 3 and not fenced.exists()


def test_a_rank_whose_checkpoint_directory_moves_under_it_still_finishes_its_save(tmp_path, monkeypatch):
    """Rank 0 sets a fenced checkpoint aside the moment its commit is refused, while another rank may still be
    counting its own files there (a CI run of the etcd-quorum test failed rank 1 with FileNotFoundError)."""
    from concurrent.futures import Future

    path = tmp_path / "step-00000015"
    path.mkdir()
    (path / "__1_0.distcp").write_bytes(b"x" * 10)
    real_stat = Path.stat

    def moved(self, *args, **kwargs):
        if self.name == "__1_0.distcp":
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return real_stat(self, *args, **kwargs)

    ckpt = Checkpointer(tmp_path)
    ckpt.rank = 1
    done = Future()
    done.set_result(None)
    monkeypatch.setattr(Path, "stat", moved)
    assert ckpt._finish(15, path, done, 0.0) is None
    monkeypatch.undo()
    assert ckpt.last_bytes == 0 and ckpt.failed_saves == 0
    ckpt.close()


def test_refused_commits_in_a_row_are_said_once_like_any_streak_of_failed_saves(tmp_path):
    """Seen in the soak: etcd lost its quorum for 20 s, the agent could not check the job's round, and the saves of
    steps 190 and 200 were refused: two checkpoint_failed incidents for one outage. A refusal is a failed save
    (save_failures.py): the first of a streak is reported, the next ones are warnings, a commit ends the streak."""
    unsure = "etcd has not confirmed node n0's membership for 14 s: the job's round cannot be checked"
    session = _FencingSession([unsure, unsure, None, unsure])
    box = Box()
    state = {"box": box}
    with Checkpointer(tmp_path, session=session) as ckpt:
        for step in (1, 2, 3, 4):
            box.n = step
            ckpt.save(step, state)
            ckpt.wait()
    failed = [step for stage, step, _ in session.events if stage == "failed"]
    assert failed == [1, 4]
    assert store.read_latest(tmp_path).step == 3 and (tmp_path / "step-00000004.fenced").is_dir()

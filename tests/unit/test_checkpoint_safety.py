"""Never delete what might be the only good copy: restore quarantines or leaves, retries before it gives up on
a checkpoint, and stops when checkpoints exist but none loads; failures are reported to the agent."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainwarden.agent.shared import checkpoint_aside as asides
from trainwarden.agent.shared import checkpoint_layout as store
from trainwarden.runtime.checkpoint import Checkpointer, CheckpointReadError, CheckpointUnloadableError

pytestmark = pytest.mark.timeout(60)


class Box:
    def __init__(self) -> None:
        self.w = torch.zeros(16)
        self.n = 0

    def state_dict(self):
        return {"w": self.w, "n": self.n}

    def load_state_dict(self, sd):
        self.w.copy_(sd["w"])
        self.n = sd["n"]


class Events:
    """Stands in for the runtime session: records the stages the Checkpointer reports."""

    def __init__(self):
        self.stages = []

    def checkpoint_event(self, stage, step, seconds=0.0, bytes=0, path="", detail=""):
        self.stages.append((stage, step, path, detail))

    def of(self, stage):
        return [s for s in self.stages if s[0] == stage]


def saved(tmp_path, steps, events=None):
    box = Box()
    with Checkpointer(tmp_path, keep=10, session=events or Events()) as ckpt:
        for step in steps:
            box.w.fill_(step)
            box.n = step
            ckpt.save(step, {"box": box})
        ckpt.wait()
    return box


# metadata whose class this torch does not have (written by another version): it unpickles elsewhere
FUTURE_METADATA = b"ctorch.distributed.checkpoint.metadata_v9\nMetadata\n)R."


def test_restore_quarantines_an_unfinished_newer_save_and_deletes_nothing(tmp_path):
    saved(tmp_path, [10])
    unfinished = store.step_dir(tmp_path, 12)
    unfinished.mkdir()
    (unfinished / "__0_0.distcp").write_bytes(b"half a save")
    events, box = Events(), Box()
    with Checkpointer(tmp_path, session=events) as ckpt:
        assert ckpt.restore({"box": box}) == 10
    assert box.n == 10
    moved = tmp_path / "step-00000012.unfinished"
    assert moved.is_dir() and (moved / "__0_0.distcp").read_bytes() == b"half a save"  # kept, not deleted
    note = json.loads((moved / asides.QUARANTINE_NOTE).read_text())
    assert note["state"] == "unfinished" and "no .metadata" in note["reason"]
    assert [(s[0], s[1]) for s in events.of("set_aside")] == [("set_aside", 12)]
    assert events.of("restored")[-1][1] == 10


def test_an_unreadable_newer_checkpoint_is_retried_then_stops_the_job_and_nothing_is_set_aside(tmp_path):
    saved(tmp_path, [10])
    unreadable = store.step_dir(tmp_path, 14)
    unreadable.mkdir()
    (unreadable / ".metadata").write_bytes(FUTURE_METADATA)
    assert store.classify(unreadable)[0] == store.UNREADABLE
    events = Events()
    with Checkpointer(tmp_path, session=events, read_backoff_s=(0.01, 0.01)) as ckpt:
        with pytest.raises(CheckpointReadError, match="cannot be read after retrying") as err:
            ckpt.restore({"box": Box()})
    assert "step-00000014" in str(err.value) and "Fix the storage" in str(err.value)
    assert (unreadable / ".metadata").exists() and store.step_dir(tmp_path, 10).is_dir()  # nothing moved
    assert not events.of("set_aside") and not events.of("restored")
    assert len(events.of("resume_blocked")) == 1


def test_a_transient_load_error_is_retried_not_quarantined(tmp_path, monkeypatch):
    saved(tmp_path, [4, 8])
    real_load, calls = dcp.load, []

    def flaky_load(*args, **kwargs):
        calls.append(str(kwargs["storage_reader"].checkpoint_id))
        if len(calls) == 1:
            raise OSError("Input/output error (a flaky NFS read)")
        return real_load(*args, **kwargs)

    monkeypatch.setattr(dcp, "load", flaky_load)
    box = Box()
    with Checkpointer(tmp_path, session=Events()) as ckpt:
        assert ckpt.restore({"box": box}, retry_delay_s=0.01) == 8
    assert box.n == 8 and len(calls) == 2 and calls[0] == calls[1]
    assert store.step_dir(tmp_path, 8).is_dir() and not list(tmp_path.glob("*.unloadable"))


def test_when_checkpoints_exist_but_none_loads_the_job_stops_instead_of_starting_over(tmp_path):
    saved(tmp_path, [4])
    wrong = {"other": torch.zeros(3)}  # step 4 does not fit this state: it fails to load, every time
    events = Events()
    with Checkpointer(tmp_path, session=events) as ckpt:
        with pytest.raises(CheckpointUnloadableError, match="none could be loaded") as err:
            ckpt.restore(wrong, retry_delay_s=0.01)
        assert "step-00000004" in str(err.value) and "--allow-fresh-start" in str(err.value)
    assert (tmp_path / "step-00000004.unloadable").is_dir()  # moved aside after every attempt failed
    assert len(events.of("resume_blocked")) == 1
    with Checkpointer(tmp_path, session=Events()) as ckpt:  # the next attempt refuses too: it was set aside
        with pytest.raises(CheckpointUnloadableError, match="set-aside checkpoints exist"):
            ckpt.restore(wrong, retry_delay_s=0.01)
    with Checkpointer(tmp_path, session=Events()) as ckpt:  # on purpose: allowed
        assert ckpt.restore(wrong, allow_fresh_start=True, retry_delay_s=0.01) is None


def test_a_directory_of_only_unfinished_saves_starts_fresh(tmp_path):
    store.step_dir(tmp_path, 3).mkdir(parents=True)
    with Checkpointer(tmp_path, session=Events()) as ckpt:
        assert ckpt.restore({"box": Box()}) is None
    assert (tmp_path / "step-00000003.unfinished").is_dir()


def test_a_failed_save_is_reported_with_its_cause_and_retention_spares_unreadable_copies(tmp_path):
    events = Events()
    (tmp_path / "step-00000002").write_text("a file where the checkpoint directory should go")
    saved(tmp_path, [1, 2], events)
    [(stage, step, path, detail)] = events.of("failed")
    assert step == 2 and detail and path.endswith("step-00000002")
    assert [s[1] for s in events.of("committed")] == [1]
    # retention (keep=1) on the next commits: an unreadable older copy and the committed history stay
    unreadable = store.step_dir(tmp_path, 3)
    unreadable.mkdir()
    (unreadable / ".metadata").write_bytes(FUTURE_METADATA)
    box = Box()
    with Checkpointer(tmp_path, keep=1, session=Events()) as ckpt:
        for step in (5, 6):
            ckpt.save(step, {"box": box})
        ckpt.wait()
    assert unreadable.is_dir() and store.step_dir(tmp_path, 6).is_dir()
    assert not store.step_dir(tmp_path, 5).exists() and not store.step_dir(tmp_path, 1).exists()


def test_counting_a_ranks_bytes_survives_rank_0_moving_the_checkpoint_mid_count(tmp_path, monkeypatch):
    """Rank 0 sets a fenced save aside (renames its directory) as soon as its commit is refused, while the
    other ranks' save threads count their own bytes in it. A rename between pathlib's is-a-directory check
    and its directory scan raised FileNotFoundError on a non-zero rank's save thread and crashed the worker
    (CI: a two-node job during an etcd quorum loss lost a round). Counting what is gone counts nothing."""
    import pathlib

    from trainwarden.runtime.checkpoint import _own_bytes

    ckpt = tmp_path / "step-00000020"
    ckpt.mkdir()
    (ckpt / "__2_0.distcp").write_bytes(b"x" * 10)
    scandir = pathlib.Path._scandir

    def moved_meanwhile(self):
        ckpt.rename(tmp_path / "step-00000020.fenced")
        return scandir(self)

    monkeypatch.setattr(pathlib.Path, "_scandir", moved_meanwhile)
    assert _own_bytes(ckpt, 2) == 0


def test_saves_reuse_the_stagers_buffers_even_where_torch_closes_its_copier_after_each_stage(tmp_path,
                                                                                               monkeypatch):
    # torch 2.11's DefaultStager._stage ends with `self._state_dict_stager.close()` (2.13 does not), which
    # drops the cached buffers and empties the copier's dispatch table: every save after the first failed
    # with KeyError(type) (seen on an H100, torch 2.11). This stages as 2.11 does.
    from torch.distributed.checkpoint.staging import DefaultStager

    stage = DefaultStager._stage

    def stage_as_in_torch_2_11(self, state_dict, **kwargs):
        staged = stage(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return staged

    monkeypatch.setattr(DefaultStager, "_stage", stage_as_in_torch_2_11)
    box, events = Box(), Events()
    with Checkpointer(tmp_path, keep=10, session=events) as ckpt:
        copier = ckpt._stager._state_dict_stager
        for step in range(3):
            box.w.fill_(step)
            box.n = step
            ckpt.save(step, {"box": box, "meta": {"kind": Box}})  # a class among the values
            ckpt.wait()
            ckpt._stager.close()  # as some torch versions' async_save do with a caller's stager
            assert len(copier._cached_storage_mapping) == 1  # box.w's buffer, kept for the next save
        assert ckpt.failed_saves == 0, ckpt.last_error
        assert ckpt.last_committed.step == 2
    assert len(copier._cached_storage_mapping) == 0  # released with the Checkpointer
    restored = Box()
    with Checkpointer(tmp_path, keep=10, session=Events()) as ckpt:
        ckpt.restore({"box": restored, "meta": {"kind": Box}})
    assert restored.n == 2 and float(restored.w[0]) == 2.0


def test_a_save_says_when_this_ranks_write_ended_before_it_commits(tmp_path):
    """Every rank reports ``written`` when its own background write ends (rank 0 then commits): the watchdog
    keeps the steps that overlapped a write out of the step time a hang's deadline follows."""
    events = Events()
    saved(tmp_path, [3, 6], events)
    order = [(s[0], s[1]) for s in events.stages]
    assert sorted(order) == sorted((stage, step) for step in (3, 6)
                                   for stage in ("save_start", "staged", "written", "committed")), order
    # "staged" comes from the training thread and "written" from the writer's: under load either may be first
    for step in (3, 6):
        at = {stage: order.index((stage, step)) for stage in ("save_start", "staged", "written", "committed")}
        assert at["save_start"] < at["staged"] and at["save_start"] < at["written"] < at["committed"], order
    assert order.index(("committed", 3)) < order.index(("committed", 6)), order
    # a synchronous save reports its write's end first: the agent compares steps, not the order
    sync = Events()
    with Checkpointer(tmp_path / "sync", keep=10, session=sync, async_save=False) as ckpt:
        ckpt.save(4, {"box": Box()})
    assert [s[0] for s in sync.stages] == ["save_start", "written", "committed", "staged"]


def test_damaged_pickled_bytes_are_described_by_what_failed_not_by_torchs_advice_to_trust_the_file():
    import io
    import pickle

    from trainwarden.runtime.checkpoint.errors import describe

    with pytest.raises(pickle.UnpicklingError) as err:  # the damage DCP meets in a .distcp's pickled entry
        torch.load(io.BytesIO(b"\xff" * 64), weights_only=True)
    assert "weights_only" in str(err.value) and len(str(err.value)) > 500  # torch's paragraph
    said = describe(err.value)
    assert said.startswith("UnpicklingError: a pickled entry could not be read (") and len(said) < 200, said
    assert "weights_only" not in said and "trusted source" not in said
    assert describe(ValueError("size mismatch")) == "ValueError: size mismatch"

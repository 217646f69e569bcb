"""Never start over by accident (DESIGN invariants): a job that has ever committed a checkpoint does not train
from step 1 on any attempt, after any rename, unless told to; a read problem is not corruption; nothing that
restore sets aside is ever deleted. Each test here reproduces a way a job used to lose its run."""

from __future__ import annotations


import pytest
import torch

from trainwarden.agent.shared import checkpoint_aside as asides
from trainwarden.agent.shared import checkpoint_layout as store
from trainwarden.runtime.checkpoint import Checkpointer, CheckpointReadError, CheckpointUnloadableError

from test_checkpoint_safety import Box, Events, saved

pytestmark = pytest.mark.timeout(60)

FAST = (0.01, 0.01)


class Agent(Events):
    """A session whose node agent answers what etcd's job record says was committed."""

    def __init__(self, step=None, path=""):
        super().__init__()
        self.record = (step, path, "found" if step is not None else "none recorded")

    def committed_record(self):
        return self.record


def restore(directory, session=None, **kwargs):
    with Checkpointer(directory, session=session or Events(), read_backoff_s=FAST) as ckpt:
        return ckpt.restore({"box": Box()}, retry_delay_s=0.01, **kwargs)


def test_committed_checkpoints_whose_metadata_vanished_stop_the_job_and_are_never_unfinished(tmp_path):
    # the repro: every .metadata gone (a lagging shared filesystem), the pointer still names step 12
    saved(tmp_path, [4, 8, 12])
    for step in (4, 8, 12):
        (store.step_dir(tmp_path, step) / store.METADATA_NAME).unlink()
    events = Events()
    with pytest.raises(CheckpointReadError, match="storage problem"):
        restore(tmp_path, events)
    assert all(store.step_dir(tmp_path, s).is_dir() for s in (4, 8, 12))  # left where they are
    assert not asides.list_set_aside(tmp_path) and not events.of("set_aside")
    # retention after a later commit never takes them for unfinished saves
    with Checkpointer(tmp_path, keep=1, session=Events()) as ckpt:
        ckpt.save(20, {"box": Box()})
        ckpt.wait()
    assert all(store.step_dir(tmp_path, s).is_dir() for s in (4, 8, 12))


def test_without_the_commit_marker_the_pointer_alone_says_the_newest_was_committed(tmp_path):
    saved(tmp_path, [4, 8, 12])  # as an older trainwarden wrote them: no COMMITTED marker
    for step in (4, 8, 12):
        (store.step_dir(tmp_path, step) / store.METADATA_NAME).unlink()
        (store.step_dir(tmp_path, step) / store.COMMIT_MARKER).unlink()
    with pytest.raises(CheckpointReadError, match="step-00000012"):
        restore(tmp_path)
    assert store.step_dir(tmp_path, 12).is_dir() and not (tmp_path / "step-00000012.unfinished").exists()


def test_every_checkpoint_corrupt_stops_the_first_attempt_and_every_restart(tmp_path):
    # the repro: every .metadata overwritten; restore sets them aside as corrupt (proof: they read wrong)
    saved(tmp_path, [4, 8, 12])
    for step in (4, 8, 12):
        (store.step_dir(tmp_path, step) / store.METADATA_NAME).write_bytes(b"garbage\n")
    with pytest.raises(CheckpointUnloadableError, match="none could be loaded"):
        restore(tmp_path)
    assert sorted(a.state for a in asides.list_set_aside(tmp_path)) == ["corrupt"] * 3
    # torchrun's restart finds no step-N left: it used to train from step 1 and exit 0
    with pytest.raises(CheckpointUnloadableError, match="set-aside checkpoints exist"):
        restore(tmp_path)
    (tmp_path / store.POINTER_NAME).unlink()  # even with the pointer gone, the set-aside ones count
    with pytest.raises(CheckpointUnloadableError):
        restore(tmp_path)


def test_etcds_record_alone_is_evidence_of_a_commit(tmp_path):
    recorded = Agent(12, str(tmp_path / "step-00000012"))
    with pytest.raises(CheckpointUnloadableError, match="etcd's record: step 12"):
        restore(tmp_path, recorded)
    elsewhere = Agent(12, "/elsewhere/ckpt/step-00000012")  # a record of another directory is not counted
    assert restore(tmp_path, elsewhere) is None
    assert restore(tmp_path, Agent()) is None  # a job that never committed starts fresh


def test_a_record_newer_than_any_directory_resumes_from_the_newest_complete_one(tmp_path):
    saved(tmp_path, [4, 8])
    assert restore(tmp_path, Agent(12, str(tmp_path / "step-00000012"))) == 8


def test_a_read_error_while_loading_stops_the_job_and_quarantines_nothing(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    saved(tmp_path, [4, 8])

    def stale_handle(*args, **kwargs):
        raise OSError(116, "Stale file handle")

    monkeypatch.setattr(dcp, "load", stale_handle)
    with pytest.raises(CheckpointReadError, match="Stale file handle"):
        restore(tmp_path)
    assert store.step_dir(tmp_path, 8).is_dir() and not asides.list_set_aside(tmp_path)


def test_retention_never_deletes_what_restore_set_aside(tmp_path):
    saved(tmp_path, [1])
    for name in ("step-00000002.unfinished", "step-00000003.corrupt", "step-00000001.unloadable",
                 "step-00000002.superseded", "step-00000003.fenced"):
        (tmp_path / name).mkdir()
    with Checkpointer(tmp_path, keep=1, session=Events()) as ckpt:
        for step in (5, 6):
            ckpt.save(step, {"box": Box()})
        ckpt.wait()
    left = {a.path.name for a in asides.list_set_aside(tmp_path)}
    assert left == {"step-00000002.unfinished", "step-00000003.corrupt", "step-00000001.unloadable",
                    "step-00000002.superseded"}  # only a stale round's fenced save goes


def test_a_fresh_start_on_purpose_keeps_the_old_checkpoints_out_of_the_new_runs_way(tmp_path):
    saved(tmp_path, [4, 8])
    (store.step_dir(tmp_path, 8) / store.METADATA_NAME).write_bytes(b"garbage")
    wrong = {"other": torch.zeros(3)}
    with Checkpointer(tmp_path, session=Events(), read_backoff_s=FAST) as ckpt:
        assert ckpt.restore(wrong, allow_fresh_start=True, retry_delay_s=0.01) is None
    assert not store.scan(tmp_path)  # nothing left for the new run's saves to overwrite
    states = {a.path.name: a.state for a in asides.list_set_aside(tmp_path)}
    assert states == {"step-00000008.corrupt": "corrupt", "step-00000004.unloadable": "unloadable"}


def test_restore_aside_puts_a_repaired_checkpoint_back(tmp_path):
    saved(tmp_path, [4])
    good = (store.step_dir(tmp_path, 4) / store.METADATA_NAME).read_bytes()
    (store.step_dir(tmp_path, 4) / store.METADATA_NAME).write_bytes(b"garbage")
    with pytest.raises(CheckpointUnloadableError):
        restore(tmp_path)
    with pytest.raises(store.CheckpointError, match="still corrupt"):
        asides.restore_aside(tmp_path, "step-00000004.corrupt")
    (tmp_path / "step-00000004.corrupt" / store.METADATA_NAME).write_bytes(good)  # the storage is fixed
    target, state = asides.restore_aside(tmp_path, "step-00000004.corrupt")
    assert state == store.COMPLETE and target == store.step_dir(tmp_path, 4)
    assert restore(tmp_path) == 4
    with pytest.raises(store.CheckpointError, match="not a set-aside checkpoint"):
        asides.restore_aside(tmp_path, "step-00000004")


def test_a_read_problem_stops_the_job_even_when_a_fresh_start_is_allowed(tmp_path):
    # the storage is broken: a fresh run's saves would fail the same way, and the checkpoint may be intact
    saved(tmp_path, [4])
    (store.step_dir(tmp_path, 4) / store.METADATA_NAME).write_bytes(b"ctorch.distributed.checkpoint.v9\nM\n)R.")
    with Checkpointer(tmp_path, session=Events(), read_backoff_s=FAST) as ckpt:
        with pytest.raises(CheckpointReadError):
            ckpt.restore({"box": Box()}, allow_fresh_start=True)
    assert store.classify(store.step_dir(tmp_path, 4))[0] == store.UNREADABLE

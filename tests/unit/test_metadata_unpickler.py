"""The allow-list unpickler of checkpoint metadata (issue 44, item 1): a real DCP checkpoint's ``.metadata`` loads,
a pickle that would run code is refused by name and runs nothing, reads are bounded and follow no link, and the
workers' restore reads metadata through the same allow-list."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from trainwarden.agent.shared import checkpoint_layout as store
from trainwarden.agent.shared.metadata_unpickler import ALLOWED_GLOBALS, MetadataRefused, load_metadata
from trainwarden.agent.shared.regular_file import NotARegularFile, read_regular
from trainwarden.runtime.checkpoint.metadata_reader import AllowListReader

pytestmark = pytest.mark.timeout(60)


def make_checkpoint(directory: Path, step: int) -> Path:
    """A DCP checkpoint with tensors and a non-tensor entry (a ``BytesStorageMetadata`` item)."""
    path = store.step_dir(directory, step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"w": torch.full((64,), 1.0), "b": torch.arange(8, dtype=torch.int64),
                  "h": torch.zeros(2, 3, dtype=torch.bfloat16), "lr": 0.5, "name": "gpt"},
                 checkpoint_id=str(path), no_dist=True)
    return path


class RunsACommand:
    """What a job's user would plant: unpickling it runs ``command``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def planted(path: Path, marker: Path) -> bytes:
    """A ``.metadata`` whose unpickling writes ``marker``, hidden inside DCP-looking data."""
    payload = pickle.dumps({"storage_data": {}, "evil": RunsACommand(f"id -u > {marker}")})
    path.mkdir(parents=True, exist_ok=True)
    (path / ".metadata").write_bytes(payload)
    return payload


def test_a_real_checkpoints_metadata_loads_as_pickle_loads_it(tmp_path):
    path = make_checkpoint(tmp_path, 3)
    data = (path / ".metadata").read_bytes()
    ours, plain = load_metadata(data), pickle.loads(data)
    assert ours.storage_data.keys() == plain.storage_data.keys()
    assert ours.state_dict_metadata == plain.state_dict_metadata
    assert store.classify(path) == (store.COMPLETE, [])


def test_a_pickle_that_runs_a_command_is_refused_by_name_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    payload = planted(store.step_dir(tmp_path, 7), marker)
    with pytest.raises(MetadataRefused, match=r"names posix\.system, which a checkpoint's metadata never holds"):
        load_metadata(payload)
    state, (problem,) = store.classify(store.step_dir(tmp_path, 7))
    assert state == store.UNREADABLE
    assert "unreadable: the metadata names posix.system, which a checkpoint's metadata never holds" in problem
    assert not marker.exists()


@pytest.mark.parametrize("target", ["builtins.eval", "builtins.getattr", "torch.load", "subprocess.Popen",
                                    "torch.serialization.load"])
def test_no_callable_that_runs_or_loads_anything_is_admitted(target):
    module, name = target.rsplit(".", 1)
    assert (module, name) not in ALLOWED_GLOBALS
    payload = b"\x80\x04c" + module.encode() + b"\n" + name.encode() + b"\n."
    with pytest.raises(MetadataRefused, match=target.replace(".", r"\.")):
        load_metadata(payload)


def test_the_read_is_bounded(tmp_path, monkeypatch):
    path = make_checkpoint(tmp_path, 3)
    size = (path / ".metadata").stat().st_size
    with pytest.raises(NotARegularFile, match=f"holds {size} bytes, more than the {size - 1} read at most"):
        read_regular(path / ".metadata", size - 1)
    assert read_regular(path / ".metadata", size) == (path / ".metadata").read_bytes()
    monkeypatch.setattr(store, "MAX_METADATA_BYTES", size - 1)
    state, (problem,) = store.classify(path)
    assert state == store.UNREADABLE and "read at most" in problem


def test_a_link_or_a_fifo_is_not_followed_and_never_blocks(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(pickle.dumps({"not": "yours"}))
    linked = store.step_dir(tmp_path, 1)
    linked.mkdir()
    (linked / ".metadata").symlink_to(secret)
    fifo = store.step_dir(tmp_path, 2)
    fifo.mkdir()
    os.mkfifo(fifo / ".metadata")
    (tmp_path / "step-00000003").symlink_to(make_checkpoint(tmp_path / "elsewhere", 3))
    assert store.classify(linked)[0] == store.UNREADABLE and "is a symbolic link" in store.classify(linked)[1][0]
    assert store.classify(fifo)[0] == store.UNREADABLE and "not a regular file" in store.classify(fifo)[1][0]
    state, (problem,) = store.classify(tmp_path / "step-00000003")
    assert state == store.UNREADABLE and "never through a link" in problem


def test_metadata_cannot_name_a_file_outside_its_checkpoint(tmp_path):
    path = make_checkpoint(tmp_path, 3)
    metadata = pickle.loads((path / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    state, (problem,) = store.classify(path)
    assert state == store.CORRUPT and "not a file name in the checkpoint directory" in problem


def test_the_workers_restore_reads_metadata_through_the_allow_list(tmp_path):
    path = make_checkpoint(tmp_path, 3)
    state = {"w": torch.zeros(64), "b": torch.zeros(8, dtype=torch.int64), "h": torch.ones(2, 3, dtype=torch.bfloat16)}
    dcp.load(state, storage_reader=AllowListReader(path), no_dist=True)
    assert torch.equal(state["w"], torch.full((64,), 1.0)) and torch.equal(state["b"], torch.arange(8))
    marker = tmp_path / "ran"
    planted(path, marker)
    with pytest.raises(CheckpointException, match=r"the metadata names posix\.system"):  # DCP's BaseException
        dcp.load(state, storage_reader=AllowListReader(path), no_dist=True)
    assert not marker.exists()


def test_a_flight_recorder_dump_that_is_a_link_or_a_fifo_is_not_read(tmp_path):
    from trainwarden.agent.shared.contract import stacks_file, trace_file
    from trainwarden.agent.watchdog.culprit import read_diagnostics

    elsewhere = tmp_path / "elsewhere.fr"
    elsewhere.write_bytes(pickle.dumps({"entries": []}))
    (tmp_path / trace_file(0)).symlink_to(elsewhere)
    os.mkfifo(tmp_path / trace_file(1))
    for rank in (0, 1):
        (tmp_path / stacks_file(rank)).write_text("")
    found = read_diagnostics(tmp_path, [0, 1])
    assert not found[0].recorded and not found[1].recorded


def test_verify_reads_only_the_checkpoints_own_regular_files(tmp_path):
    """``trainwarden checkpoints --verify`` (root) hashes the files the commit marker names: the marker is the job
    user's, so a path out of the directory is not read, and a FIFO neither blocks nor is hashed."""
    import json

    from trainwarden.agent.shared import checkpoint_sums

    path = make_checkpoint(tmp_path, 3)
    sums = {name: {"sum": "0", "bytes": 1, "rank": 0} for name in ("/dev/zero", "../../etc/shadow")}
    (path / store.COMMIT_MARKER).write_text(json.dumps({"step": 3, "sums": {"algorithm": checkpoint_sums.ALGORITHM,
                                                                           "files": sums}}))
    wrong = checkpoint_sums.verify(path)
    assert sorted(m.file for m in wrong) == sorted(sums)
    assert all(m.found == "not a file name in the checkpoint directory: not read" for m in wrong)
    os.mkfifo(path / "pipe")
    with pytest.raises(NotARegularFile, match="not a regular file"):
        checkpoint_sums.verify(path, sums={"pipe": {"sum": "0", "bytes": 1, "rank": 0}})

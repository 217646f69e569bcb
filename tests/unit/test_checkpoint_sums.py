"""Checksums of a checkpoint's files (issue 48, item 1): recorded at commit, verified at restore and on demand.

Before: a byte flipped in the middle of a tensor file of the newest committed checkpoint went unnoticed; the job
resumed from it with a corrupted weight. Now restore sets it aside as ``corrupt`` (naming the file, the rank that
wrote it and both sums) and uses the checkpoint before it; `trainwarden checkpoints --verify` finds it on demand.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from trainwarden.agent.shared import checkpoint_aside as asides
from trainwarden.agent.shared import checkpoint_layout as store
from trainwarden.agent.shared import checkpoint_sums
from trainwarden.runtime.checkpoint import Checkpointer


class Events:
    def __init__(self) -> None:
        self.stages: list[tuple[str, int, str, str]] = []

    def checkpoint_event(self, stage, step, seconds, bytes, *, path="", detail=""):
        self.stages.append((stage, step, path, detail))


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((4096,), value), "b": torch.arange(100, dtype=torch.float64) * value},
            "meta": {"note": f"saved with {value}"}}


def _save(directory: Path, steps) -> None:
    with Checkpointer(directory, keep=5, memory_dir=False) as ckpt:
        for step in steps:
            ckpt.save(step, _state(float(step)))
            assert ckpt.wait().step == step


def _flip_a_byte(path: Path) -> Path:
    data = max((p for p in path.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    return data


def test_every_data_file_of_a_commit_has_its_sum_recorded_and_it_matches_the_bytes(tmp_path):
    _save(tmp_path, [3])
    path = store.step_dir(tmp_path, 3)
    sums = checkpoint_sums.recorded_sums(path)
    data = sorted(p.name for p in path.iterdir() if p.suffix == ".distcp")
    assert data and sorted(sums) == data
    for name in data:
        assert (sums[name]["sum"], sums[name]["bytes"]) == checkpoint_sums.file_sum(path / name)
        assert sums[name]["rank"] == 0
    assert checkpoint_sums.verify(path) == []


def test_a_flipped_byte_sets_the_newest_aside_as_corrupt_and_the_one_before_is_used(tmp_path):
    _save(tmp_path, [10, 20])
    newest = store.step_dir(tmp_path, 20)
    damaged = _flip_a_byte(newest)
    events = Events()
    restored = _state(0.0)
    with Checkpointer(tmp_path, keep=5, session=events, memory_dir=False) as ckpt:
        assert ckpt.restore(restored) == 10
    assert float(restored["model"]["w"][0]) == 10.0  # never the corrupted weights
    assert not newest.exists()
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("step-00000020.corrupt")]
    note = json.loads((aside / asides.QUARANTINE_NOTE).read_text())
    assert damaged.name in note["reason"] and "written by rank 0" in note["reason"]
    recorded = checkpoint_sums.recorded_sums(aside)[damaged.name]["sum"]
    assert recorded in note["reason"] and checkpoint_sums.file_sum(aside / damaged.name)[0] in note["reason"]
    (set_aside,) = [s for s in events.stages if s[0] == "set_aside"]  # one incident naming it
    assert set_aside[1] == 20 and damaged.name in set_aside[3]


def test_a_checkpoint_without_recorded_sums_is_loaded_unverified(tmp_path):
    _save(tmp_path, [5])
    marker = store.step_dir(tmp_path, 5) / store.COMMIT_MARKER
    marker.write_text(json.dumps({"step": 5, "time": 0}))  # as written before sums existed
    restored = _state(0.0)
    with Checkpointer(tmp_path, keep=5, memory_dir=False) as ckpt:
        assert ckpt.restore(restored) == 5
    assert float(restored["model"]["w"][0]) == 5.0


def test_checkpoints_verify_names_the_damaged_file_and_exits_8(tmp_path):
    _save(tmp_path, [1, 2])
    cmd = [sys.executable, "-m", "trainwarden.agent.cli", "checkpoints", "--job", "j", "--dir", str(tmp_path),
           "--verify"]
    good = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert good.returncode == 0 and good.stdout.count("verified: ok") == 2, good.stdout + good.stderr
    damaged = _flip_a_byte(store.step_dir(tmp_path, 2))
    bad = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 8, bad.stdout + bad.stderr
    rows = {r["step"]: r for r in json.loads(bad.stdout)["checkpoints"]}
    assert rows[2]["state"] == "CORRUPT" and damaged.name in rows[2]["verified"]
    assert rows[1]["verified"].startswith("ok")
    assert "differ from the sums recorded" in bad.stderr


def test_the_hashing_stream_hashes_what_it_writes_and_falls_back_to_the_file_after_a_seek(tmp_path):
    from trainwarden.runtime.checkpoint.sums import HashingFileSystem

    sums: dict = {}
    fs = HashingFileSystem(sums)
    with fs.create_stream(tmp_path / "a", "wb") as stream:
        stream.write(b"hello ")
        stream.write(memoryview(b"world"))
    with fs.create_stream(tmp_path / "b", "wb") as stream:
        stream.write(b"xxxxx")
        stream.seek(0)
        stream.write(b"y")
    for name in ("a", "b"):
        assert (sums[name]["sum"], sums[name]["bytes"]) == checkpoint_sums.file_sum(tmp_path / name)
    torch.save(torch.ones(3), buf := io.BytesIO())
    with fs.create_stream(tmp_path / "c", "wb") as stream:
        torch.save(torch.ones(3), stream)
    assert sums["c"]["bytes"] == os.path.getsize(tmp_path / "c") == len(buf.getvalue())

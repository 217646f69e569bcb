"""A full checkpoint disk (issue 45, item 2), on a real file system that fills up: a 1 MiB tmpfs.

Saves that hit ENOSPC fail cleanly: the partial ``step-N`` directory is removed at once, nothing partial is committed,
the last good checkpoint stays the job's state (retention never deletes it to make room), the failure is said once
(one error line, one report to the agent: one incident) however many saves fail in a row, and the first save after
space returns commits, which ends the streak with a line that says how many saves were lost.
"""

from __future__ import annotations

import logging
import os
import subprocess

import pytest
import torch

from trainwarden.agent.shared import checkpoint_layout as store
from trainwarden.runtime.checkpoint import Checkpointer

pytestmark = pytest.mark.integration


class Events:
    """The runtime session's checkpoint reports, as the node agent would receive them."""

    def __init__(self) -> None:
        self.stages: list[tuple[str, int, str]] = []

    def checkpoint_event(self, stage, step, seconds, bytes, *, path="", detail=""):
        self.stages.append((stage, step, detail))


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounts a 1 MiB tmpfs: needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tw-test-full", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((64 * 1024,), value)}}  # 256 KiB of float32


def test_saves_on_a_full_disk_fail_once_leave_nothing_partial_keep_the_last_good_one_and_commit_after(
        small_disk, caplog):
    events = Events()
    ckpt_dir = small_disk / "ckpt"
    filler = small_disk / "filler"
    with caplog.at_level(logging.INFO, logger="trainwarden.runtime.checkpoint"), \
            Checkpointer(ckpt_dir, keep=1, session=events, memory_dir=False) as ckpt:
        ckpt.save(1, _state(1.0))
        assert ckpt.wait().step == 1
        filler.write_bytes(b"\0" * (600 * 1024))  # what is left cannot hold a second checkpoint
        for step in (2, 3, 4):
            ckpt.save(step, _state(float(step)))
            assert ckpt.wait() is None
            assert not store.step_dir(ckpt_dir, step).exists()  # its partial directory is gone at once
            assert store.read_latest(ckpt_dir).step == 1  # the last good one is still the job's state
            assert store.step_dir(ckpt_dir, 1).is_dir()
        assert ckpt.failed_saves == 3
        failed = [s for s in events.stages if s[0] == "failed"]
        assert len(failed) == 1 and failed[0][1] == 2, events.stages  # one report, one incident, for the streak
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("trainwarden")]
        assert len(errors) == 1 and "full (ENOSPC)" in errors[0].getMessage(), [r.getMessage() for r in errors]
        assert "never deleted to make room" in errors[0].getMessage()
        assert caplog.text.count("failed again") == 2

        filler.unlink()  # space returns
        ckpt.save(5, _state(5.0))
        assert ckpt.wait().step == 5
    assert store.read_latest(ckpt_dir).step == 5
    assert "checkpoint saves work again: step 5 committed after 3 failed save(s) since step 2" in caplog.text
    assert sorted(p.name for p in ckpt_dir.iterdir() if p.name.startswith("step-")) == ["step-00000005"]
    restored = _state(0.0)
    with Checkpointer(ckpt_dir, keep=1, memory_dir=False) as again:
        again.restore(restored)
    assert float(restored["model"]["w"][0]) == 5.0


def test_a_new_streak_after_a_commit_is_said_again(small_disk, caplog):
    events = Events()
    ckpt_dir = small_disk / "ckpt"
    filler = small_disk / "filler"
    with caplog.at_level(logging.INFO, logger="trainwarden.runtime.checkpoint"), \
            Checkpointer(ckpt_dir, keep=1, session=events, memory_dir=False) as ckpt:
        ckpt.save(1, _state(1.0))
        ckpt.wait()
        for step in (2, 4):  # fail, commit, fail: two streaks
            filler.write_bytes(b"\0" * (600 * 1024))
            ckpt.save(step, _state(float(step)))
            assert ckpt.wait() is None
            filler.unlink()
            ckpt.save(step + 1, _state(float(step + 1)))
            assert ckpt.wait().step == step + 1
    assert [s[1] for s in events.stages if s[0] == "failed"] == [2, 4]

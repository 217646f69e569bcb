"""The ownership hand-over changes only what root made, by descriptor, and fails into a refusal (issue 44, item 4).

These run as root for real: root gives a job's state directory to ``nobody`` while the directory holds what a job's
user could have put there (a hard link to root's file, a FIFO or a link where root's directory was, the state
directory itself a link). Before this, ``hand_over`` walked the tree with ``os.fwalk`` and chowned every entry.
"""

from __future__ import annotations

import os
import stat
import threading

import pytest

from trainwarden.agent.common.untrusted_fs import UntrustedPathError, open_dir, read_small
from trainwarden.agent.node.job_user import HandOverError, JobUser, hand_over, state_dir_problem

NOBODY = JobUser(name="nobody", uid=65534, gid=65534, groups=(65534,), home="/nonexistent")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="changes file owners as root: needs root")


def _hand_over_within(seconds: float, *args, **kwargs):
    """``hand_over`` in a thread: what it raised, or a failure when it blocked (a FIFO opened without O_NONBLOCK)."""
    outcome: list = []

    def run():
        try:
            hand_over(*args, **kwargs)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail("hand_over blocked")
    return outcome[0]


@pytest.fixture
def tree(tmp_path):
    """``<home>/jobs/j`` with root's ``incidents`` (a record in it) and a root-only file outside."""
    home = tmp_path / "home"
    job = home / "jobs" / "j"
    (job / "incidents").mkdir(parents=True)
    (job / "incidents" / "a.json").write_text("{}")
    secret = tmp_path / "root-only"
    secret.mkdir(mode=0o700)
    (secret / "shadow").write_text("root's")
    return home, job, secret


def test_hard_links_to_roots_files_are_not_handed_over(tree):
    home, job, secret = tree
    os.link(secret / "shadow", job / "hl")  # where fs.protected_hardlinks=0 the user can make this itself
    os.link(secret / "shadow", job / "incidents" / "hl.json")
    assert _hand_over_within(10, job, NOBODY, under=home) is None
    assert (secret / "shadow").stat().st_uid == 0
    assert job.stat().st_uid == 65534 and (job / "incidents" / "a.json").stat().st_uid == 65534


def test_a_fifo_or_a_link_where_roots_directory_was_neither_blocks_nor_is_followed(tree):
    home, job, secret = tree
    os.mkfifo(job / "diagnostics")
    (job / "exclusions").symlink_to(secret)
    assert _hand_over_within(10, job, NOBODY, under=home) is None
    assert secret.stat().st_uid == 0 and (secret / "shadow").stat().st_uid == 0
    assert os.lstat(job / "diagnostics").st_uid == 0  # the user's own entries are not touched
    assert job.stat().st_uid == 65534


def test_a_state_directory_that_is_a_link_or_a_fifo_is_refused_and_its_target_untouched(tmp_path):
    home = tmp_path / "home"
    (home / "jobs").mkdir(parents=True)
    secret = tmp_path / "root-only"
    secret.mkdir(mode=0o700)
    (home / "jobs" / "link").symlink_to(secret)
    os.mkfifo(home / "jobs" / "fifo")
    for name in ("link", "fifo"):
        exc = _hand_over_within(10, home / "jobs" / name, NOBODY, under=home)
        assert isinstance(exc, HandOverError), exc
        assert "without following a link" in str(exc) and "resume the job" in str(exc)
    assert secret.stat().st_uid == 0


def test_a_state_directory_of_another_user_is_refused_with_the_path_and_the_command(tmp_path):
    state = tmp_path / "jobs" / "j"
    state.mkdir(parents=True)
    assert state_dir_problem(tmp_path / "jobs" / "absent", NOBODY) is None
    assert state_dir_problem(state, NOBODY) is None  # root's own (the daemon made it): handed over
    (state / "incidents").mkdir()
    assert state_dir_problem(state, NOBODY) is None  # with an older release's records in it, too
    (state / "checkpoints").mkdir()
    assert "belongs to root (uid 0)" in state_dir_problem(state, NOBODY)  # a run as root left its state there
    (state / "checkpoints").rmdir()
    os.chown(state, 12345, 12345)
    why = state_dir_problem(state, NOBODY)
    assert why is not None and str(state) in why and "uid 12345" in why
    assert f"rm -r {state}" in why and f"chown -R nobody: {state}" in why
    os.chown(state, 65534, 65534)
    assert state_dir_problem(state, NOBODY) is None


def test_untrusted_reads_refuse_links_fifos_and_big_files(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "ok").write_text("fine")
    (tmp_path / "d" / "big").write_bytes(b"x" * 5000)
    os.mkfifo(tmp_path / "d" / "fifo")
    (tmp_path / "d" / "link").symlink_to(tmp_path / "d" / "ok")
    (tmp_path / "dirlink").symlink_to(tmp_path / "d")
    assert read_small(tmp_path / "d" / "ok", 100) == b"fine"
    for name, why in (("big", "more than the 4096"), ("fifo", "not a regular file"), ("link", "symbolic link")):
        with pytest.raises(UntrustedPathError, match=why):
            read_small(tmp_path / "d" / name, 4096)
    with pytest.raises(UntrustedPathError, match="not followed"):
        read_small(tmp_path / "dirlink" / "ok", 100)
    assert read_small(tmp_path / "d" / "ok", 100, under=tmp_path) == b"fine"
    fd = open_dir(tmp_path / "d")
    try:
        assert stat.S_ISDIR(os.fstat(fd).st_mode)
    finally:
        os.close(fd)

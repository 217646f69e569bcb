"""Root's reads of files in a job's state directory (issue 44, item 2): `trainwarden checkpoints`, `report` and
`status` run as root read what the job's user wrote there. A link must not point the read at root's file, and a
FIFO must not block it (before: ``read_text`` followed the link and blocked on the FIFO)."""

from __future__ import annotations

import os
import threading

from trainwarden.agent.common.job_history import read_history
from trainwarden.agent.common.paths import job_checkpoint_dir
from trainwarden.agent.node.endpoints import DEFAULT_SOCKET, resolve_socket


def _within(seconds: float, call):
    out: list = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the read blocked"
    return out[0]


def _open_fifo_writer_to_release(path) -> None:
    """Let a blocked reader of FIFO ``path`` go (so a failing test leaves no thread behind)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_a_linked_record_is_not_followed_and_a_fifo_does_not_block(tmp_path):
    home = tmp_path / "home"
    state = home / "jobs" / "j"
    (state / "history").mkdir(parents=True)
    secret = tmp_path / "secret"
    secret.write_text("/root/secret-dir\n")
    (state / "checkpoint_dir").symlink_to(secret)
    (state / "agent.sock.path").symlink_to(secret)
    assert job_checkpoint_dir("j", home) == state / "checkpoints"  # the default, not the link's target's text
    assert resolve_socket(None, "j", env={}, state_home=home) == DEFAULT_SOCKET
    (state / "checkpoint_dir").unlink()
    os.mkfifo(state / "checkpoint_dir")
    os.mkfifo(state / "history" / "steps.csv")
    try:
        assert _within(10, lambda: job_checkpoint_dir("j", home)) == state / "checkpoints"
        assert _within(10, lambda: read_history(state / "history")).empty
    finally:
        _open_fifo_writer_to_release(state / "checkpoint_dir")
        _open_fifo_writer_to_release(state / "history" / "steps.csv")

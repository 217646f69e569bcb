"""The warm zygote checks that forking is safe before every fork, not only after its imports: a client that
arrives once it is not gets no worker, and starts its own cold (runtime/zygote.py)."""

from __future__ import annotations

import os
import signal
import socket
import threading

import pytest

from trainwarden.runtime import zygote as warm
from trainwarden.runtime import zygote_client


@pytest.fixture
def zygote(tmp_path):
    before = signal.getsignal(signal.SIGCHLD)
    listener = warm._listen(str(tmp_path / "z.sock"))
    z = warm._Zygote(listener, str(tmp_path / "map"))
    yield z, str(tmp_path / "z.sock")
    listener.close()
    signal.signal(signal.SIGCHLD, before)


def _ask(path: str, replies: list) -> None:
    """A client: its request and three streams, then whatever the zygote answers (None: it hung up)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        zygote_client.send_frame(conn, {"argv": ["job.py"], "env": {"RANK": "3"}, "cwd": "/"}, [0, 1, 2])
        try:
            replies.append(zygote_client.recv_frame(conn))
        except (ConnectionError, OSError):
            replies.append(None)


def test_a_client_arriving_after_cuda_was_initialised_gets_no_worker(zygote, monkeypatch, capsys):
    z, path = zygote
    calls = []
    monkeypatch.setattr(warm, "_unsafe_to_fork", lambda: calls.append(1) or "CUDA was initialised")
    monkeypatch.setattr(warm.os, "fork", lambda: pytest.fail("forked although forking was unsafe"))
    for _ in range(2):
        replies: list = []
        client = threading.Thread(target=_ask, args=(path, replies))
        client.start()
        assert z._accept() is None
        client.join(10)
        assert replies == [None]  # hung up: the client execs a cold worker
    assert z.off == "CUDA was initialised" and calls == [1]  # checked once, then off for good
    err = capsys.readouterr().err
    assert err.count("warm workers are off for this job from now: CUDA was initialised") == 1, err
    assert z.children == {}


def test_a_zygote_whose_launcher_is_already_gone_exits_before_it_serves(tmp_path):
    """The launcher killed before its zygote asked for the parent-death signal (it starts the zygote first thing):
    the zygote lived on as an orphan, imported, re-made its swept warm directory and served forever (seen as a
    leftover tw-warm-*/zygote.sock in test_no_litter)."""
    import subprocess
    import sys

    from trainwarden.agent.shared.contract import WARM_PARENT_PID_ENV, ZYGOTE_MODULE

    env = {**os.environ, WARM_PARENT_PID_ENV: "1"}  # not this zygote's parent: its launcher went before it asked
    done = subprocess.run([sys.executable, "-m", ZYGOTE_MODULE, "--serve", str(tmp_path / "z.sock"),
                           str(tmp_path / "map"), str(tmp_path / "job.py")], env=env, timeout=120)
    assert done.returncode == -signal.SIGTERM
    assert not (tmp_path / "z.sock").exists() and not (tmp_path / "map").exists()

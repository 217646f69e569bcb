"""A client that dies before its worker (SIGKILLed by torchrun, or with its node's agent) must cost the warm zygote
only that worker: the zygote kills it and serves on (runtime/zygote.py). Found by the soak (issue 45): the
zygote kept the closed connection among its children, and its next ``select`` raised ``ValueError: file
descriptor cannot be a negative integer``: the zygote died, and with it (PR_SET_PDEATHSIG) every other worker."""

from __future__ import annotations

import select
import signal
import socket
import subprocess

import pytest

from trainwarden.runtime import zygote as warm


@pytest.fixture
def zygote(tmp_path):
    before = signal.getsignal(signal.SIGCHLD)
    (tmp_path / "map").mkdir()
    listener = warm._listen(str(tmp_path / "z.sock"))
    z = warm._Zygote(listener, str(tmp_path / "map"))
    yield z
    listener.close()
    signal.signal(signal.SIGCHLD, before)


class _Stop(Exception):
    pass


def test_a_gone_client_costs_its_worker_and_the_zygote_serves_on(zygote, tmp_path, monkeypatch):
    """The serve loop itself: it sees the closed connection, kills that client's worker, and selects again (the
    second ``select`` is the real one, with no wait, and then the test stops the loop)."""
    z = zygote
    gone_worker = subprocess.Popen(["sleep", "60"])
    other_worker = subprocess.Popen(["sleep", "60"])
    real_select, calls = select.select, []

    def select_twice(rlist, wlist, xlist, *timeout):
        calls.append(list(rlist))
        if len(calls) == 1:
            return real_select(rlist, wlist, xlist, 10)
        real_select(rlist, wlist, xlist, 0)  # raised ValueError on the closed socket's fd -1 before the fix
        raise _Stop

    monkeypatch.setattr(select, "select", select_twice)
    try:
        ours, client = socket.socketpair()
        ours_b, client_b = socket.socketpair()
        for pid, conn in ((gone_worker.pid, ours), (other_worker.pid, ours_b)):
            z.children[pid] = conn
            z.by_conn[conn.fileno()] = pid
            (tmp_path / "map" / str(pid)).write_text("1")
        client.close()  # the client died (SIGKILL): its end of the connection closes

        with pytest.raises(_Stop):
            z.run()

        assert gone_worker.wait(10) == -signal.SIGKILL  # its worker must not outlive it
        assert len(calls) == 2 and ours not in calls[1] and ours_b in calls[1]
        assert z.children[other_worker.pid] is ours_b and other_worker.poll() is None
    finally:
        for proc in (gone_worker, other_worker):
            proc.kill()
            proc.wait()

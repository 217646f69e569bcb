"""One start of torchrun (agent/launch/launched.py) with a real child standing in for it: its events and output are
read, its answers written, and closing it gives back every fd it held, however often a run launches again."""

from __future__ import annotations

import io
import os
import sys

import pytest

from trainwarden.agent.launch.launched import Launched

pytestmark = pytest.mark.timeout(60)

# stands in for torchrun: says one event, waits for our answer, prints it and ends
CHILD = """
import os, sys
events = os.fdopen(int(os.environ["TRAINWARDEN_LAUNCH_EVENTS_FD"]), "w")
events.write('{"event": "started", "round": 1}\\n'); events.flush()
answer = os.read(int(os.environ["TRAINWARDEN_LAUNCH_REPLY_FD"]), 64).decode().strip()
print("answered", answer, flush=True)
"""


def _fds() -> set[str]:
    return {f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}" for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")}


def _launch(log, lines, events):
    return Launched([sys.executable, "-c", CHILD], dict(os.environ), out=io.StringIO(), log=log,
                    on_line=lines.append, on_event=events.append)


def test_a_launch_reads_its_events_and_output_and_closing_it_gives_back_every_fd():
    before = _fds()
    log, lines, events = io.StringIO(), [], []
    launched = _launch(log, lines, events)
    launched.start_reading()
    launched.reply(b"go\n")
    assert launched.torchrun.wait(30) == 0
    launched.join()
    assert events == [{"event": "started", "round": 1}]
    assert lines == ["answered go\n"] and log.getvalue() == "answered go\n"
    launched.close()
    launched.close()  # idempotent
    launched.reply(b"late\n")  # a closed launch answers nobody, and does not raise
    assert _fds() == before


def test_launching_again_and_again_holds_no_more_than_once():
    """What a fenced node does (agent/launch/run.py): close the last launch, launch again. Before, each launch kept
    its pipe ends and torchrun's output pipe until the run ended (the daemon soak's hour: 24 -> 31 fds)."""
    before = _fds()
    log = io.StringIO()
    for _ in range(4):
        events, lines = [], []
        launched = _launch(log, lines, events)
        launched.start_reading()
        launched.reply(b"go\n")
        launched.torchrun.wait(30)
        launched.join()
        launched.close()
        assert _fds() == before
    assert log.getvalue().count("answered go") == 4


def test_a_launch_that_is_never_read_or_whose_child_still_runs_is_closed_too():
    before = _fds()
    launched = _launch(io.StringIO(), [], [])  # closed before its reading started: its events pipe too
    launched.close()
    assert launched.torchrun.poll() is not None  # stopped: it waited for an answer that never came
    assert _fds() == before


def test_a_torchrun_that_cannot_start_leaves_no_pipe_open():
    before = _fds()
    with pytest.raises(OSError):
        Launched(["/nonexistent/torchrun"], dict(os.environ), out=io.StringIO(), log=io.StringIO(),
                 on_line=print, on_event=print)
    assert _fds() == before

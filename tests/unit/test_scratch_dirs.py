"""Scratch directories a SIGKILLed run left in /tmp are removed by the next run, and only those
(agent/common/scratch.py). Before it, every hard-killed `trainwarden run` left its agent's socket directory
behind for good (three per green CI run)."""

from __future__ import annotations

import os
import subprocess
import sys

from trainwarden.agent.common.scratch import OWNER_FILE, scratch_dir, sweep


def test_a_directory_whose_owner_is_gone_is_removed_and_a_live_ones_stays(tmp_path):
    mine = scratch_dir("tw-x-", root=tmp_path)
    assert oct(mine.stat().st_mode & 0o777) == "0o700"
    # a run that is gone: a real child process made its directory and was SIGKILLed
    child = subprocess.run([sys.executable, "-c",
                            "import os, signal\n"
                            "from trainwarden.agent.common.scratch import scratch_dir\n"
                            f"print(scratch_dir('tw-x-', root={str(tmp_path)!r}), flush=True)\n"
                            "os.kill(os.getpid(), signal.SIGKILL)"], capture_output=True, text=True, timeout=60)
    assert child.returncode == -9, child.stderr
    dead = tmp_path / os.path.basename(child.stdout.strip())
    assert (dead / OWNER_FILE).is_file()
    unmarked = tmp_path / "tw-x-unmarked"  # not ours to judge: never touched
    unmarked.mkdir()
    other_prefix = scratch_dir("tw-y-", root=tmp_path)
    (other_prefix / OWNER_FILE).write_text(f"{child.stdout and 999999999} 1.0\n")
    assert sweep("tw-x-", root=tmp_path) == [dead]
    assert mine.is_dir() and unmarked.is_dir() and other_prefix.is_dir() and not dead.exists()


def test_a_reused_pid_is_not_its_owner(tmp_path):
    """The mark holds the start time: a pid now held by another process does not keep the directory."""
    stale = scratch_dir("tw-x-", root=tmp_path)
    (stale / OWNER_FILE).write_text(f"{os.getpid()} 12.0\n")  # this pid, but a process started in 1970
    malformed = scratch_dir("tw-x-", root=tmp_path)
    (malformed / OWNER_FILE).write_text("not a mark\n")  # unreadable: counted as alive, kept
    assert sweep("tw-x-", root=tmp_path) == [stale]
    assert malformed.is_dir()


def test_an_owner_killed_but_not_yet_reaped_is_gone(tmp_path):
    """A zombie is gone. Session 36's soak (daemon-run): both nodes power-killed, each daemon started its launcher
    again a second later, while the killed launchers were zombies PID 1 had not reaped yet (1.4 s on this VM's init);
    the new runs' sweeps kept the dead runs' directories, and no later sweep came."""
    import signal
    import time

    import psutil

    child = subprocess.Popen([sys.executable, "-c",
                              "import time\n"
                              "from trainwarden.agent.common.scratch import scratch_dir\n"
                              f"print(scratch_dir('tw-x-', root={str(tmp_path)!r}), flush=True)\n"
                              "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        dead = tmp_path / os.path.basename(child.stdout.readline().strip())
        assert sweep("tw-x-", root=tmp_path) == []  # alive
        child.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)  # not reaped: no wait() until the end
        assert psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE
        assert sweep("tw-x-", root=tmp_path) == [dead]
    finally:
        child.kill()
        child.wait()
        child.stdout.close()

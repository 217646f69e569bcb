"""What the benchmark scripts share: running a command in its own session, and stopping it."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def stop_group(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM the process group of `proc` (started with start_new_session=True), SIGKILL after `grace`."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_in_session(cmd: list[str], *, env: dict, log: Path, timeout: float | None) -> int | None:
    """Run ``cmd`` in a session of its own, its output to ``log``: its exit code, or None when it ran past
    ``timeout``. Its process group is stopped either way."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        stop_group(proc)

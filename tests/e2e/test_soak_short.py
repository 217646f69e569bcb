"""The soak's short run (issue 45, item 1: "a short run, one seed, a few minutes, belongs in the extended tier").

`tests/bench/soak.py` as a user runs it, on the multi-node bed it builds (two nodes, a 3-member etcd): five minutes
of the reference job, seed 6 drawing 8 faults of 7 kinds one every 25-40 s (disk full, SIGSTOP, rank crash, a
truncated checkpoint with a power loss, etcd quorum lost twice, a NaN loss, an etcd member killed), after the
fault-free run of the same job. Every invariant must hold and the run must say so in its last line. Then the
daemon-run variant (``--daemon``): the same job submitted to a node daemon per node, with the daemon's own SIGKILL
among the faults. The hour's run and its table are in BENCHMARKS.md ("Soak").
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from testbed import TestBed

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(1800)]

SOAK = Path(__file__).resolve().parents[1] / "bench" / "soak.py"


def _soak(*args: str) -> tuple[int, str]:
    """``soak.py`` with ``args``; its exit code and output. No --keep: the soak works in a directory of its own under
    /tmp (pytest's tmp_path is too long for the agents' unix sockets) and removes it at the end."""
    reason = TestBed.unavailable()
    if reason:
        pytest.skip(reason)
    cmd = [sys.executable, str(SOAK), "--minutes", "5", "--step-s", "0.55", "--gap-s", "25,40", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=1700)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the soak stops where it is on SIGTERM, tears its bed down and judges what it saw
        out, _ = proc.communicate(timeout=120)
        pytest.fail(f"the soak ran past 1700 s; its end:\n{out[-6000:]}")
    return proc.returncode, out


def _verdict(out: str) -> tuple[int, int, int]:
    last = re.findall(r"^soak: (\d+) faults of (\d+) kinds in [\d.]+ min; invariants broken: (\d+)$", out, re.M)
    assert last, out[-6000:]
    assert len(re.findall(r"^invariant \w+: ok", out, re.M)) == 9, out[-6000:]
    return tuple(int(x) for x in last[-1])


def test_five_minutes_of_faults_break_no_invariant():
    rc, out = _soak("--seed", "6")
    assert _verdict(out) == (8, 7, 0) and rc == 0, out[-6000:]


def test_five_minutes_of_faults_on_daemon_run_nodes_break_no_invariant():
    """The daemon-run variant: a node daemon per node, the job submitted. Seed 7 draws n1's launcher killed (its
    daemon starts it again), two rank crashes, a truncated checkpoint with a power loss of both nodes (each daemon,
    started again, must start its node's part again), n1's daemon SIGKILLed three times (each next daemon must adopt
    the running launcher) and n1 killed."""
    rc, out = _soak("--daemon", "--seed", "7", "--kinds", "daemon_kill,node_kill,agent_kill,crash,ckpt_corrupt,partition")
    assert _verdict(out) == (8, 5, 0) and rc == 0, out[-6000:]
    assert len(re.findall(r"launcher pid \d+ adopted", out)) == 3, out[-6000:]

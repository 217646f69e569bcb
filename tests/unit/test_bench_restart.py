"""tests/bench/bench_restart.py: the phase arithmetic on recorded output, and the process watch on real processes."""

import datetime as dt
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from _proctree import Worker, WorkerWatch  # noqa: E402
from bench_restart import PHASES, breakdown, describe, table, torch_lines  # noqa: E402

pytestmark = pytest.mark.timeout(30)

FAULT = dt.datetime(2026, 11, 24, 10, 0, 0).timestamp()


def _log(seconds: float) -> str:
    """A worker log timestamp `seconds` after the fault."""
    return dt.datetime.fromtimestamp(FAULT + seconds).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]


def _glog(seconds: float) -> str:
    return dt.datetime.fromtimestamp(FAULT + seconds).strftime("I%m%d %H:%M:%S.%f")


AGENT_LOG = f"""\
{_glog(-20)} 4242 torch/distributed/elastic/agent/server/api.py:553] [default] Rendezvous complete for workers. Result:
{_glog(0.31)} 4242 torch/distributed/elastic/agent/server/api.py:932] [default] Worker group FAILED. 1/1 attempts left; will restart worker group
{_glog(0.32)} 4242 torch/distributed/elastic/agent/server/api.py:733] [default] Stopping worker group
{_glog(1.40)} 4242 torch/distributed/elastic/agent/server/api.py:707] [default] Rendezvous'ing worker group
{_glog(1.90)} 4242 torch/distributed/elastic/agent/server/api.py:553] [default] Rendezvous complete for workers. Result:
"""
OUTPUT = f"""\
{_log(-3)} [rank 4] trainwarden.runtime.examples.gpt: step 15 loss 5.1 time 0.2s tok/s 100
{_log(14.0)} [rank 0] trainwarden.runtime.examples.gpt: resumed from checkpoint step 10 in /c
{_log(15.5)} [rank 4] trainwarden.runtime.examples.gpt: step 11 loss 5.3 time 0.2s tok/s 100
{_log(15.7)} [rank 4] trainwarden.runtime.examples.gpt: step 12 loss 5.2 time 0.2s tok/s 100
"""


def _marks(nproc=2):
    marks = [{"phase": "imported", "t": FAULT - 30, "rank": 0, "pid": 1, "restart_count": 0}]
    for rank in range(nproc):
        for phase, t in (("imported", 10.0), ("pg_up", 11.0), ("mesh_up", 12.0), ("model_built", 13.0),
                         ("restored", 14.5)):
            marks.append({"phase": phase, "t": FAULT + t + rank * 0.1, "rank": rank, "pid": 10 + rank,
                          "restart_count": 1})
    return marks


def test_breakdown_of_a_recorded_restart():
    workers = [Worker(1, FAULT - 40, FAULT + 0.05), Worker(2, FAULT - 40, FAULT + 1.2),
               Worker(11, FAULT + 2.05, None), Worker(12, FAULT + 2.3, None)]
    row = breakdown(FAULT, OUTPUT, AGENT_LOG, _marks(), workers, nproc=2)
    assert [row[p] for p in PHASES] == [1.2, 0.31, 1.9, 2.05, 10.1, 11.1, 12.1, 13.1, 14.6, 15.5]
    assert row["evidence"]["resumed_from_step"] == 10
    assert row["evidence"]["rdzv_begin_s"] == 1.4
    assert row["evidence"]["rank_spread_s"]["imported"] == 0.1
    assert row["evidence"]["notes"] == []
    line = describe({"launcher": "torchrun", "rc": 0, **row})
    assert "old gone 1.20 (+1.20), detected 0.31 (-0.89)" in line and "started 2.05 (+0.15)" in line and "first step 15.50 (+0.90)" in line
    assert "| torchrun | 1 | 1.2 (+1.2) | 0.3 (-0.9) | 1.9 (+1.6) |" in table([{"launcher": "torchrun", "rc": 0, **row}],
                                                                ["torchrun"])


def test_missing_evidence_is_none_and_said():
    row = breakdown(FAULT, "", "", _marks(nproc=1), [Worker(1, FAULT - 40, None)], nproc=2)
    assert row["detected"] is None and row["old_gone"] is None and row["first_step"] is None
    assert row["imported"] == 10.0
    assert "1 workers seen before the fault, expected 2" in row["evidence"]["notes"]
    assert "imported: 1 of 2 ranks marked it" in row["evidence"]["notes"]
    assert "old gone - (-), detected - (-)" in describe({"launcher": "trainwarden", "rc": 1, **row})


def test_torch_lines_take_the_year_given():
    [(t, message)] = torch_lines(f"[{_glog(0.5)} 17 a.py:1] [default] Stopping worker group\nnoise\n", 2026)
    assert t == pytest.approx(FAULT + 0.5) and message == "[default] Stopping worker group"


def test_watch_sees_children_start_and_go(procs, tmp_path):
    started = time.time()
    root = procs.spawn(["sh", "-c", "sleep 0.5 & sleep 1.0 & wait"], log=tmp_path / "sh.log")
    watch = WorkerWatch(root.pid, lambda cmdline: cmdline[:1] == ["sh"], scan_s=0.05)
    watch.start()
    try:
        assert root.wait(10) == 0
        time.sleep(0.1)
    finally:
        watch.stop()
    workers = watch.workers()
    assert watch.launcher == root.pid and watch.error is None and len(workers) == 2
    for worker, lives in zip(workers, (0.5, 1.0)):
        assert started - 0.05 <= worker.started <= started + 0.5  # exact to a clock tick, not psutil's whole second
        assert worker.gone is not None and worker.gone - worker.started == pytest.approx(lives, abs=0.2)
    assert watch.kill_leftovers() == []

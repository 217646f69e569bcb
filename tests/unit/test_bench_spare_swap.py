"""tests/bench/bench_spare_swap.py: the recovery arithmetic on recorded-like output."""

import datetime as dt
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from bench_spare_swap import _steps, _window, recovery  # noqa: E402

pytestmark = pytest.mark.timeout(30)

KILL = dt.datetime(2026, 11, 29, 10, 0, 0).timestamp()


def _log(seconds: float) -> str:
    return dt.datetime.fromtimestamp(KILL + seconds).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]


def _glog(seconds: float) -> str:
    return dt.datetime.fromtimestamp(KILL + seconds).strftime("I%m%d %H:%M:%S.%f")


def _step(seconds: float, n: int, took: float = 0.3) -> str:
    return f"{_log(seconds)} [rank 0] trainwarden.runtime.examples.gpt: step {n} loss 9.876543 time {took:.3f}s tok/s 1\n"


OUTPUT = (_step(-0.6, 99) + _step(-0.3, 100) + _step(-0.01, 101)
          + f"{_log(5.2)} [rank 0] trainwarden.runtime.checkpoint.memory: resumed from the memory snapshot of step 101 "
            "taken 5.3 s before\n"
          + _step(6.4, 102, 1.1) + _step(6.7, 103))
JOB_LOG = (f"{_glog(-90)} 4242 torch/distributed/elastic/agent/server/api.py:553] [default] Rendezvous complete for "
           "workers. Result:\n"
           f"{_glog(0.9)} 4242 torch/distributed/elastic/agent/server/api.py:553] [default] Rendezvous complete for "
           "workers. Result:\n")
SPARE_LOG = (f"{_glog(0.9)} 77 torch/distributed/elastic/agent/server/api.py:553] [default] Rendezvous complete for "
             "workers. Result:\n"
             f"{_glog(0.9)} 77 torch/distributed/elastic/agent/server/api.py:553]   global_ranks=[2, 3]\n")


def test_the_swap_is_timed_from_the_kill_to_rank_0s_first_step_after_its_restore():
    row = recovery(KILL, OUTPUT, JOB_LOG, SPARE_LOG)
    assert row == {"rdzv_s": 0.9, "restore_s": 5.2, "train_s": 6.4, "lost": 0, "spare_ranks": [[2, 3]],
                   "source": "memory"}


def test_the_step_time_window_is_rank_0s_own_step_times():
    steps = _steps(OUTPUT)
    assert [n for _, n, _ in steps] == [99, 100, 101, 102, 103]
    assert _window(steps, 101, 2) == [0.3, 1.1]

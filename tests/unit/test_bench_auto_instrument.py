"""tests/bench/bench_auto_instrument.py: its arithmetic on recorded numbers, and its process bookkeeping on real
processes."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from bench_auto_instrument import (CpuSampler, Family, hang_report, overhead_report,  # noqa: E402
                                   paired_effect, summarize_steps)

pytestmark = pytest.mark.timeout(30)


def test_step_statistics_pool_the_ranks():
    rows0 = [(1.0, 0.050, 0.048, 0.049), (1.05, 0.060, 0.048, 0.050)]
    rows1 = [(1.1, 0.052, 0.050, 0.051), (1.15, 0.054, 0.050, 0.052)]
    s = summarize_steps([rows0, rows1])
    assert s["steps"] == 4 and s["measured_from_s"] == 1.0
    assert s["median_s"] == pytest.approx(0.053) and s["mean_s"] == pytest.approx(0.054)
    assert s["thread_cpu_s"] == pytest.approx(0.049)
    assert s["off_cpu_s"] == pytest.approx(0.005)  # wall less the training thread's CPU
    assert s["background_cpu_s"] == pytest.approx(0.0015)  # process CPU less the training thread's


def _side(median, foreign):
    return {"median_s": median, "mean_s": median, "thread_cpu_s": 0.05, "off_cpu_s": 0.001,
            "background_cpu_s": 0.0005, "foreign_cores": foreign}


def test_the_overhead_report_gives_ratios_round_by_round_and_over_the_quiet_rounds():
    results = {"auto": [_side(0.0502, 0.01), _side(0.080, 0.6)], "plain": [_side(0.0500, 0.02), _side(0.060, 0.05)]}
    lines = overhead_report(results, quiet_below=0.1)
    text = "\n".join(lines)
    assert "per round 1.0040 .. 1.3333" in text
    quiet = lines[lines.index(next(x for x in lines if x.startswith("the 1 round(s)"))) + 1]
    assert "ratio 1.0040" in quiet and "+200 us" in quiet


def test_the_hang_report_names_misses_and_wrong_ranks():
    trials = [{"rank": 0, "detected_s": 5.1, "named_s": 5.3, "ranks": [0]},
              {"rank": 1, "detected_s": 5.2, "named_s": 8.2, "ranks": [0, 1]},
              {"rank": 0, "detected_s": None}]
    text = "\n".join(hang_report(trials))
    assert "median 5.15 s" in text and "range 5.30 .. 8.20 s" in text and "2 of 3 trials" in text
    assert "(1, [0, 1])" in text and "1 trial(s) without" in text


def test_other_work_is_the_machine_s_busy_time_less_ours():
    sampler = CpuSampler()
    tck = os.sysconf("SC_CLK_TCK")
    sampler.samples = [(10.0, 1000, 500), (11.0, 1000 + tck, 500 + tck // 2), (12.0, 1000 + 2 * tck, 500 + tck)]
    assert sampler.foreign_cores(10.0, 12.0) == pytest.approx(0.5)
    assert sampler.foreign_cores(10.5, 10.9) is None  # too few samples inside


def test_the_family_finds_descendants_and_kills_only_what_it_saw(tmp_path):
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
             "time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        family = Family(proc.pid)
        deadline = time.monotonic() + 10
        while not family.scan() and time.monotonic() < deadline:
            time.sleep(0.05)
        (child,) = family.scan()
        os.kill(proc.pid, signal.SIGKILL)  # the parent dies: the child outlives it, reparented
        proc.wait()
        assert family.alive() == [child]
        family.signal(signal.SIGKILL)
        deadline = time.monotonic() + 5
        while family.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert family.alive() == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_paired_effect_is_the_mean_ratio_and_can_be_net_of_other_work():
    # per round: auto / plain - 1 = 0.2 % + 10 % per core that the auto run had more of other work
    foreign = [0.0, 0.5, 0.1, 0.0, 0.3, 0.0]
    auto = [_side(0.050 * (1.002 + 0.10 * f), f) for f in foreign]
    plain = [_side(0.050, 0.0) for _ in foreign]
    mean, stderr, adjusted = paired_effect(auto, plain)
    assert mean == pytest.approx(0.002 + 0.10 * sum(foreign) / 6) and stderr > 0
    assert adjusted[0] == pytest.approx(0.002) and adjusted[1] == pytest.approx(0.0, abs=1e-9)
    quiet = [_side(0.050 * r, 0.0) for r in (1.001, 0.999, 1.003, 0.997)]
    mean, stderr, adjusted = paired_effect(quiet, [_side(0.050, 0.0)] * 4)
    assert mean == pytest.approx(0.0) and adjusted is None  # no difference in other work to fit on
    assert paired_effect(auto[:1], plain[:1]) is None

"""The goodput ledger (agent/launch/goodput.py) on timelines of jobs of several shapes: every second of the wall
time lands in one place, a recomputed step counts once, and the counters only grow."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from trainwarden.agent.launch.goodput import CAUSES, GoodputLedger


def _steps(ledger, first: int, last: int, *, t0: float, step_s: float, gap_s: float = 0.0, ranks: int = 1) -> float:
    """Steps ``first``..``last`` from ``t0``; each reported by ``ranks`` ranks; the time after the last one."""
    t = t0
    for index in range(first, last + 1):
        t += step_s
        for r in range(ranks):
            ledger.step(index, t + 0.001 * r, step_s)
        t += gap_s
    return t


def _sums_to_wall(g) -> None:
    assert g.productive_s + sum(g.badput_s.values()) == pytest.approx(g.wall_s, abs=0.02), g


def test_a_clean_run_is_startup_then_steps_and_the_gaps_between_them():
    ledger = GoodputLedger("j", launched_at=100.0)
    ledger.round_started()
    _steps(ledger, 1, 50, t0=110.0, step_s=0.5, gap_s=0.1, ranks=8)
    g = ledger.snapshot()
    assert g.badput_s["startup"] == pytest.approx(10.0)
    assert g.productive_s == pytest.approx(25.0)
    assert g.badput_s["between_steps"] == pytest.approx(4.9)  # 49 gaps: the last one is after the last step
    _sums_to_wall(g)
    assert g.ratio == pytest.approx(25.0 / 39.9, rel=1e-3) and "startup 10.0s" in g.describe()


def test_a_crash_after_step_17_resumed_from_step_10_counts_steps_11_to_17_once():
    ledger = GoodputLedger("j", launched_at=0.0)
    ledger.round_started()
    end = _steps(ledger, 1, 17, t0=5.0, step_s=1.0, ranks=4)  # the last step ends at 22
    ledger.failed(end + 0.4)                                     # the step in flight, then the report
    ledger.round_started()
    _steps(ledger, 11, 30, t0=end + 0.4 + 6.0, step_s=1.0, ranks=4)  # 6 s to restart, resume at 11
    g = ledger.snapshot()
    assert g.productive_s == pytest.approx(30.0)  # steps 1..30 once
    assert g.badput_s["lost_progress"] == pytest.approx(7.0)  # the first run of 11..17
    assert g.badput_s["detection"] == pytest.approx(0.4) and g.badput_s["restart"] == pytest.approx(6.0)
    assert g.badput_s["startup"] == pytest.approx(5.0)
    _sums_to_wall(g)


def test_a_hang_waits_in_detection_and_two_failures_before_a_step_are_one_outage():
    ledger = GoodputLedger("j", launched_at=0.0)
    ledger.round_started()
    end = _steps(ledger, 1, 10, t0=2.0, step_s=0.2)
    ledger.failed(end + 30.0)  # the watchdog's deadline, then the abort
    ledger.round_started()
    ledger.failed(end + 35.0)  # the first restart dies before a step
    ledger.round_started()
    _steps(ledger, 11, 12, t0=end + 40.0, step_s=0.2)
    g = ledger.snapshot()
    assert g.badput_s["detection"] == pytest.approx(30.0) and g.badput_s["restart"] == pytest.approx(10.0)
    assert g.badput_s["lost_progress"] == 0.0
    _sums_to_wall(g)


def test_a_regroup_without_a_failure_is_rendezvous_and_late_reports_of_other_ranks_do_not_count():
    ledger = GoodputLedger("j", launched_at=0.0)
    ledger.round_started()
    end = _steps(ledger, 1, 5, t0=1.0, step_s=2.0, ranks=2)
    ledger.round_started(end + 1.0)  # a node joined: everyone checkpointed after step 5 and regrouped
    ledger.step(5, end + 0.002, 2.0)  # a slow rank's report of step 5 from the old round, after the new one began
    _steps(ledger, 6, 8, t0=end + 3.0, step_s=2.0, ranks=3)
    g = ledger.snapshot()
    assert g.productive_s == pytest.approx(16.0) and g.badput_s["lost_progress"] == 0.0
    assert g.badput_s["rendezvous"] == pytest.approx(3.0)
    _sums_to_wall(g)


def test_the_metrics_name_every_cause_and_the_counters_never_go_down():
    ledger = GoodputLedger("gpt", launched_at=0.0, node="n0")
    registry = CollectorRegistry()
    registry.register(ledger)
    text = generate_latest(registry).decode()
    assert 'trainwarden_goodput_ratio' in text and 'trainwarden_goodput_ratio{' not in text  # no step: no ratio
    seen = {}
    ledger.round_started()
    end = _steps(ledger, 1, 8, t0=3.0, step_s=1.0)
    for event in (lambda: ledger.failed(end + 1), ledger.round_started,
                  lambda: _steps(ledger, 5, 12, t0=end + 4, step_s=1.0)):
        event()
        g = ledger.snapshot()
        for cause in CAUSES:
            assert g.badput_s[cause] >= seen.get(cause, 0.0)
            seen[cause] = g.badput_s[cause]
    text = generate_latest(registry).decode()
    for cause in CAUSES:
        assert f'trainwarden_badput_seconds_total{{cause="{cause}",job="gpt",node="n0"}}' in text
    assert 'trainwarden_goodput_ratio{job="gpt",node="n0"}' in text

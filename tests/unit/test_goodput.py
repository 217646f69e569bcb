"""The goodput ledger (agent/launch/goodput.py) on timelines of jobs of several shapes: every second of the wall
time lands in one place, a recomputed step counts once, and the counters only grow."""

from __future__ import annotations

import json

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


def test_a_hang_the_watchdog_found_is_hang_not_detection_and_restore_is_taken_out_of_restart():
    ledger = GoodputLedger("j", launched_at=0.0)
    ledger.round_started()
    ledger.restored(1.5)  # a fresh start that still read a checkpoint: out of startup
    end = _steps(ledger, 1, 10, t0=4.0, step_s=0.5, ranks=2)
    ledger.hang_detected()
    ledger.failed(end + 20.0)
    ledger.round_started(end + 21.0)
    ledger.restored(2.0)
    ledger.restored(3.0)  # the slowest rank's restore counts
    _steps(ledger, 11, 14, t0=end + 26.0, step_s=0.5, ranks=2)
    g = ledger.snapshot()
    assert g.badput_s["hang"] == pytest.approx(20.0) and g.badput_s["detection"] == 0.0
    assert g.badput_s["restore"] == pytest.approx(4.5)
    assert g.badput_s["startup"] == pytest.approx(2.5) and g.badput_s["restart"] == pytest.approx(3.0)
    _sums_to_wall(g)


def test_a_checkpoint_stall_is_taken_out_of_the_gap_after_its_step_never_more_than_the_gap():
    ledger = GoodputLedger("j", launched_at=0.0)
    ledger.round_started()
    ledger.step(1, 2.0, 1.0)
    ledger.checkpoint_stall(1, 0.2)
    ledger.checkpoint_stall(1, 0.3)  # the slowest rank
    ledger.checkpoint_stall(1, 0.1)
    ledger.step(2, 3.5, 1.0)  # gap 0.5: 0.3 stall, 0.2 between steps
    ledger.checkpoint_stall(2, 5.0)
    ledger.step(3, 4.6, 1.0)  # gap 0.1: all of it stall, the rest of the report is not invented
    g = ledger.snapshot()
    assert g.badput_s["checkpoint_stall"] == pytest.approx(0.4)
    assert g.badput_s["between_steps"] == pytest.approx(0.2)
    _sums_to_wall(g)


@pytest.mark.parametrize("cause", ["straggler", "comm_regression"])
@pytest.mark.parametrize("step_s", [0.05, 2.0])
def test_while_a_slow_cause_is_open_the_excess_over_the_jobs_median_step_is_charged_to_it(cause, step_s):
    ledger = GoodputLedger("j", launched_at=0.0)
    ledger.round_started()
    end = _steps(ledger, 1, 20, t0=1.0, step_s=step_s)
    ledger.slow(cause, True)
    end = _steps(ledger, 21, 30, t0=end, step_s=step_s * 3)  # three times slower for ten steps
    ledger.slow(cause, False)
    _steps(ledger, 31, 40, t0=end, step_s=step_s)
    g = ledger.snapshot()
    assert g.badput_s[cause] == pytest.approx(10 * 2 * step_s)
    assert g.productive_s == pytest.approx(40 * step_s)
    _sums_to_wall(g)
    with pytest.raises(ValueError):
        ledger.slow("hang", True)


def test_a_resumed_ledger_counts_the_time_away_as_stopped_and_redoes_steps_the_last_launcher_ran():
    first = GoodputLedger("j", launched_at=0.0, node="a")
    first.round_started()
    _steps(first, 1, 20, t0=5.0, step_s=1.0)  # the last step ends at 25; the job stops there
    state = json.loads(json.dumps(first.state()))  # as it travels through etcd
    second = GoodputLedger("j", launched_at=100.0, node="b")
    second.resume(state, now=100.0)
    second.round_started(100.0)
    _steps(second, 16, 30, t0=104.0, step_s=1.0)  # resumed from the checkpoint of step 15
    g = second.snapshot()
    assert g.badput_s["stopped"] == pytest.approx(75.0)
    assert g.badput_s["startup"] == pytest.approx(5.0 + 4.0)  # both launches'
    assert g.badput_s["lost_progress"] == pytest.approx(5.0) and g.productive_s == pytest.approx(30.0)
    assert g.wall_s == pytest.approx(119.0)
    _sums_to_wall(g)


def test_steps_the_others_trained_while_this_node_was_away_are_productive_not_the_wait_before_its_round():
    """The hour's soak: n1's ledger, away (killed, fenced or a spare) while n0 trained 40 steps alone, charged those
    40 steps to the wait before its next round (rendezvous); n0 later carried n1's ledger on after a power loss, and
    its time in rounds fell 2.2 % short of the workers' step log. Steps 21..60 were kept: they are productive, at the
    job's recent pace, and only the rest of the wait is the round's cause."""
    ledger = GoodputLedger("j", launched_at=0.0, node="n1")
    ledger.round_started(0.0)
    t = _steps(ledger, 1, 20, t0=5.0, step_s=1.0)  # n1 leaves after step 20, at 25
    ledger.round_started(t + 50.0)  # it comes back: n0 trained 21..60 meanwhile, and saved 60
    _steps(ledger, 61, 70, t0=t + 52.0, step_s=1.0)
    g = ledger.snapshot()
    assert g.productive_s == pytest.approx(20 + 40 + 10)
    assert g.badput_s["rendezvous"] == pytest.approx(52.0 - 40.0)
    _sums_to_wall(g)


def test_steps_a_relaunch_never_heard_of_come_out_of_the_stopped_time_not_its_start_up():
    """A launcher killed 10 steps after its last published state: the next launcher resumes from that state and
    the job from step 30; steps 21..30 ran before the launch, in what the resume counts as stopped."""
    first = GoodputLedger("j", launched_at=0.0)
    first.round_started()
    _steps(first, 1, 20, t0=5.0, step_s=1.0)
    state = first.state()  # published at 25; the job trains on to step 30 (35), then the power goes
    second = GoodputLedger("j", launched_at=60.0)
    second.resume(state, now=60.0)
    second.round_started(60.0)
    _steps(second, 31, 40, t0=64.0, step_s=1.0)
    g = second.snapshot()
    assert g.productive_s == pytest.approx(20 + 10 + 10)
    assert g.badput_s["stopped"] == pytest.approx(35.0 - 10.0) and g.badput_s["startup"] == pytest.approx(5.0 + 4.0)
    _sums_to_wall(g)


def test_a_resume_further_back_than_the_carried_steps_estimates_them_with_their_mean():
    first = GoodputLedger("j", launched_at=0.0)
    first.round_started()
    _steps(first, 1, 600, t0=0.0, step_s=0.1)
    state = first.state()
    assert len(state["recent"]) == 512
    second = GoodputLedger("j", launched_at=70.0)
    second.resume(state, now=70.0)
    second.round_started(70.0)
    _steps(second, 1, 600, t0=71.0, step_s=0.1)  # no checkpoint at all: everything redone
    g = second.snapshot()
    assert g.badput_s["lost_progress"] == pytest.approx(60.0) and g.productive_s == pytest.approx(60.0)
    _sums_to_wall(g)


@pytest.mark.parametrize("broken", [{}, {"launched": 5.0, "as_of": 1.0, "productive_s": 0, "badput_s": {}},
                                    {"launched": "x", "as_of": 1.0, "productive_s": 0, "badput_s": {}}])
def test_a_malformed_persisted_state_is_refused_and_changes_nothing(broken):
    ledger = GoodputLedger("j", launched_at=10.0)
    with pytest.raises((ValueError, KeyError, TypeError)):
        ledger.resume(broken, now=10.0)
    assert ledger.snapshot().wall_s == 0.0 and ledger.state()["launched"] == 10.0


def test_incidents_drive_the_hang_and_slow_causes_until_each_open_one_is_resolved():
    ledger = GoodputLedger("j", launched_at=0.0)
    ledger.round_started()
    end = _steps(ledger, 1, 10, t0=1.0, step_s=1.0)
    ledger.incident("straggler_start", "open", "s1")
    ledger.incident("straggler_start", "open", "s2")  # two ranks
    end = _steps(ledger, 11, 12, t0=end, step_s=2.0)
    ledger.incident("straggler_start", "resolved", "s1")
    end = _steps(ledger, 13, 13, t0=end, step_s=2.0)  # s2 still open
    ledger.incident("straggler_start", "resolved", "s2")
    ledger.incident("straggler_end", "resolved", "s3")  # the end's own record changes nothing
    end = _steps(ledger, 14, 14, t0=end, step_s=2.0)  # closed: the whole step is the job's
    ledger.incident("hang", "open", "h1")
    ledger.failed(end + 9.0)
    g = ledger.snapshot()
    assert g.badput_s["straggler"] == pytest.approx(3.0) and g.badput_s["hang"] == pytest.approx(9.0)
    assert g.productive_s == pytest.approx(15.0)
    _sums_to_wall(g)


def test_a_restart_further_back_than_the_steps_kept_in_memory_estimates_the_older_ones(monkeypatch):
    """A ledger keeps the last ``_RECENT`` steps, not every step of a week-long job; a restart further back than
    those charges the older ones at their mean."""
    import trainwarden.agent.launch.goodput as goodput

    monkeypatch.setattr(goodput, "_RECENT", 50)
    ledger = GoodputLedger("j", launched_at=0.0)
    ledger.round_started(0.0)
    t = _steps(ledger, 1, 200, t0=0.0, step_s=0.1)
    assert len(ledger.state()["recent"]) == 50
    ledger.failed(t + 1.0)
    ledger.round_started(t + 2.0)
    _steps(ledger, 1, 200, t0=t + 3.0, step_s=0.1)  # no checkpoint: every step redone
    g = ledger.snapshot()
    assert g.badput_s["lost_progress"] == pytest.approx(20.0) and g.productive_s == pytest.approx(20.0)
    _sums_to_wall(g)

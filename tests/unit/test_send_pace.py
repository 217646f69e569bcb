"""Steps held back while they keep ending (runtime/send_pace.py): the worker's side, the store's promise, the pacer's
request and the hang detector's judgement of a job whose ranks promise their next batch."""

from collections import deque

from prometheus_client import CollectorRegistry, generate_latest

from test_watchdog import Actions, Sim, _watchdog
from trainwarden.agent.incidents import IncidentKind
from trainwarden.agent.watchdog.hang import HangConfig
from trainwarden.agent.watchdog.interface import WatchdogConfig
from trainwarden.runtime.send_pace import SendPace

def _step():
    return ("step", object())  # a new object each time: a new step in the queue


def test_the_sender_holds_only_steps_that_keep_ending_under_a_promise_and_withdraws_it_when_they_stop():
    pace, q = SendPace(0.5, "step"), deque()
    # at its own pace nothing is held
    q.append(_step())
    pace.look(q)
    assert not pace.may_hold(0.5, len(q)) and pace.sending(0.5) == (0.0, False)
    q.clear()
    pace.ask(2.0)
    assert pace.asked_s == 2.0
    # the first batch after the ask goes at once, promising the next
    q.append(_step())
    pace.look(q)
    assert not pace.may_hold(1.0, len(q))
    assert pace.sending(1.0) == (2.0, False)
    q.clear()
    # steps keep ending: held until the promise's time is up
    for now in (1.5, 2.0, 2.5):
        q.append(_step())
        pace.look(q)
        assert pace.may_hold(now, len(q))
    q.append(_step())
    pace.look(q)
    assert not pace.may_hold(3.0, len(q)) and pace.sending(3.0) == (2.0, False)
    assert pace.held == 3
    q.clear()
    # they stop: the next look sends at once, withdrawing the promise, even with nothing queued
    pace.look(q)
    assert not pace.may_hold(3.5, len(q)) and pace.sending(3.5) == (0.0, True)
    pace.look(q)
    assert pace.sending(4.0) == (0.0, False)  # said once
    # they start again: the first batch goes at once
    q.append(_step())
    pace.look(q)
    assert not pace.may_hold(4.5, len(q)) and pace.sending(4.5) == (2.0, False)
    # a step queued but not new since the last look (nothing sent meanwhile) is not "keeps ending"
    pace.look(q)
    assert not pace.may_hold(5.0, len(q)) and pace.sending(5.0) == (0.0, True)


def test_a_new_stream_a_final_batch_and_asks_out_of_range_promise_nothing():
    pace, q = SendPace(0.5, "step"), deque([_step()])
    pace.ask(2.0)
    pace.look(q)
    assert pace.sending(0.0) == (2.0, False)
    pace.new_stream()  # a reconnect: the agent there was told nothing
    q.append(_step())
    pace.look(q)
    assert pace.asked_s == 0 and pace.sending(1.0) == (0.0, False)
    pace.ask(2.0)
    q.append(_step())
    pace.look(q)
    assert pace.sending(2.0, final=True) == (0.0, False)  # the goodbye's batch
    for asked, applied in ((0.5, 0.0), (0.2, 0.0), (float("nan"), 0.0), (600.0, 10.0), (-1.0, 0.0)):
        pace.ask(asked)
        assert pace.asked_s == applied, asked
    # a full queue goes whatever the pace
    pace.ask(2.0)
    q.append(_step())
    pace.look(q)
    pace.sending(3.0)
    q.extend(_step() for _ in range(300))
    pace.look(q)
    assert not pace.may_hold(3.5, len(q))


def test_the_store_keeps_a_promise_for_twice_its_time_and_a_batch_without_one_after_it_says_the_steps_stopped():
    sim = Sim(ranks=2)
    js, clock = sim.js, sim.clock

    def rank(r):
        return js.snapshot("j")[0].ranks[r]

    js.record_steps_promise("j", 0, 0.0)  # the worker's own pace: neither promised nor stopped
    assert not rank(0).steps_promised and not rank(0).steps_stopped
    js.record_steps_promise("j", 0, 2.0)
    clock.now += 3.9
    assert rank(0).steps_promised
    clock.now += 0.2
    assert not rank(0).steps_promised and not rank(0).steps_stopped  # a late sender: no promise, no stop
    js.record_steps_promise("j", 0, 2.0)
    js.record_steps_promise("j", 0, 0.0)
    assert not rank(0).steps_promised and rank(0).steps_stopped
    js.record_steps_promise("j", 0, 2.0)
    assert rank(0).steps_promised and not rank(0).steps_stopped
    # a new stream has promised nothing
    js.disconnect("j", 0, 100)
    sim.connect(pid_base=100)
    assert not rank(0).steps_promised and not rank(0).steps_stopped


def test_quiet_jobs_whose_ranks_all_report_steps_are_asked_to_hold_them(tmp_path):
    sim = Sim(ranks=4)
    actions = Actions()
    wd = _watchdog(sim, actions, tmp_path, quiet_read_period_s=6.0, quiet_after_s=10.0)
    for _ in range(8):
        sim.run(7)
        wd.check_once()
    assert actions.paces == [("j", [0, 1, 2, 3], 6.0)] and actions.sends == [2.0]
    registry = CollectorRegistry()
    registry.register(wd.collector())
    assert 'trainwarden_step_send_pace_seconds{job="j",node="n1"} 2.0' in generate_latest(registry).decode()
    near = {"j"}
    wd._comm.detector.near_decision = lambda job: job in near
    sim.run(7)
    wd.check_once()
    assert actions.paces[-1] == ("j", [0, 1, 2, 3], 0.0) and actions.sends[-1] == 0.0  # both back to their own
    # a job with a rank that reports no steps is read slowly but its steps are never held: its progress is its
    # newest step, and a rank without steps promises nothing
    sim2 = Sim(ranks=2)
    actions2 = Actions()
    wd2 = _watchdog(sim2, actions2, tmp_path, quiet_read_period_s=6.0, quiet_after_s=10.0)
    for _ in range(8):
        sim2.clock.now += 2.0
        sim2.js.record_step("j", 0, index=1, start_unix=sim2.clock.now - 1, duration_seconds=1.0)
        wd2.check_once()
    assert actions2.paces == [("j", [0, 1], 6.0)] and actions2.sends == [0.0]
    wd3 = _watchdog(Sim(ranks=2), Actions(), tmp_path, quiet_step_send_s=0.0)
    assert wd3._pacer._send_s == 0.0


def _promise(sim, within=2.0, ranks=None):
    for r in range(sim.ranks) if ranks is None else ranks:
        sim.js.record_steps_promise("j", r, within)


def test_a_job_whose_ranks_keep_their_promises_is_not_hung_and_one_whose_ranks_stop_is_on_its_usual_deadline(
        tmp_path):
    """The deadline is 5 s here (the test's floor); the ranks hold their steps for up to 8 s (an ask of 4 s, late)."""
    sim = Sim(ranks=2)
    actions = Actions(answer={0, 1})
    wd = _watchdog(sim, actions, tmp_path)
    for _ in range(5):
        sim.run(2)
        _promise(sim, 4.0)
        wd.check_once()
    # steps go on but their batch comes 7 s after the last one: not a hang, though the newest step heard of is
    # older than the deadline
    for _ in range(7):
        sim.clock.now += 1.0
        wd.check_once()
    assert actions.records == []
    sim.run(2)
    _promise(sim, 4.0)
    wd.check_once()
    # both ranks stop (a hang) and say so at their next look: the deadline runs from their last step's end
    sim.clock.now += 0.5
    _promise(sim, 0.0)
    wd.check_once()
    sim.clock.now += 4.3
    wd.check_once()
    assert actions.records == []
    sim.clock.now += 0.3
    wd.check_once()
    assert actions.records[0].kind is IncidentKind.HANG


def test_a_stopped_rank_that_cannot_withdraw_its_promise_is_caught_when_the_others_say_they_stopped(tmp_path):
    """A SIGSTOPped rank's sender stops with it: its promise stands, but the ranks waiting for it in the next
    collective say their steps stopped, and the job is judged on its newest step as before."""
    sim = Sim(ranks=2)
    actions = Actions(answer={0})
    wd = _watchdog(sim, actions, tmp_path)
    for _ in range(5):
        sim.run(2)
        _promise(sim, 4.0)
        wd.check_once()
    sim.clock.now += 0.5
    _promise(sim, 0.0, ranks=[0])  # rank 1 is stopped: it says nothing
    wd.check_once()
    sim.clock.now += 4.9
    wd.check_once()
    assert [i.kind for i in actions.records][:1] == [IncidentKind.HANG]  # 5.4 s after the last step, not 8 s


def test_every_rank_silent_past_its_promise_is_judged_on_the_newest_step(tmp_path):
    """Every sender stuck at once (each rank's GIL held by a stuck native call): the promises lapse after twice
    their time, and the newest step is then older than the deadline: a hang, later by the promises' time."""
    sim = Sim(ranks=2)
    actions = Actions(answer={0, 1})
    wd = _watchdog(sim, actions, tmp_path)
    for _ in range(5):
        sim.run(2)
        _promise(sim, 4.0)
        wd.check_once()
    for _ in range(7):
        sim.clock.now += 1.1  # past the 5 s deadline, within the 8 s the promises hold
        wd.check_once()
    assert actions.records == [] and wd._hang.stalled_s("j") == 0.0
    sim.clock.now += 0.4
    wd.check_once()
    assert [i.kind for i in actions.records][:1] == [IncidentKind.HANG]


def test_a_batch_promising_what_no_worker_may_is_counted_invalid_and_promises_nothing():
    from trainwarden.agent.shared import telemetry_pb2 as pb
    from trainwarden.agent.telemetry.records import apply_record

    sim = Sim(ranks=1)
    info = sim.js.snapshot("j")[0].ranks[0]
    from trainwarden.agent.telemetry.snapshots import WorkerInfo

    worker = WorkerInfo(job="j", rank=0, local_rank=0, world_size=1, mesh=sim.mesh, pid=info.pid, hostname="host0")
    for within in (float("inf"), float("nan"), 600.0, -1.0):
        apply_record(sim.js, worker, pb.WorkerMessage(steps=pb.Steps(next_within_seconds=within)))
    assert sim.js.rejected()["invalid"] == 4
    assert not sim.js.snapshot("j")[0].ranks[0].steps_promised
    apply_record(sim.js, worker, pb.WorkerMessage(steps=pb.Steps(next_within_seconds=10.0)))
    assert sim.js.snapshot("j")[0].ranks[0].steps_promised


def test_the_step_send_period_comes_from_the_environment_within_its_bounds(monkeypatch):
    import pytest

    from trainwarden.agent.node.agent import QUIET_STEP_SEND_ENV, watchdog_config

    with pytest.raises(ValueError, match="quiet_step_send_s"):
        WatchdogConfig(quiet_step_send_s=11.0, hang=HangConfig())
    assert watchdog_config().quiet_step_send_s == 2.0
    monkeypatch.setenv(QUIET_STEP_SEND_ENV, "0")
    assert watchdog_config().quiet_step_send_s == 0.0
    for bad in ("later", "-1", "11"):
        monkeypatch.setenv(QUIET_STEP_SEND_ENV, bad)
        with pytest.raises(ValueError, match="TRAINWARDEN_QUIET_STEP_SEND_S.*between 0 .never ask.* and 10"):
            watchdog_config()

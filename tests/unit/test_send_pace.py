"""Steps held back while they keep ending (runtime/send_pace.py): the worker's side, the store's promise, the pacer's
request and the hang detector's judgement of a job whose ranks promise their next batch."""

from collections import deque

from prometheus_client import CollectorRegistry, generate_latest

from test_watchdog import Actions, Sim, _watchdog
from trainwarden.agent.incidents import IncidentKind
from trainwarden.agent.watchdog.hang import HangConfig
from trainwarden.agent.watchdog.interface import WatchdogConfig
from trainwarden.runtime.send_pace import SendPace

def _end(record):
    return record[1] if record[0] == "step" else None


class Worker:
    """A sender's view: steps queued at a wall time, a look every 0.5 s (monotonic = wall here)."""

    def __init__(self, asked=2.0):
        self.pace, self.q, self.t = SendPace(0.5, _end), deque(), 0.0
        self.pace.ask(asked)

    def step(self, before_look=0.0):
        """A step that ended `before_look` seconds before the next look (a new tuple: a new record)."""
        self.q.append(("step", self.t + 0.5 - before_look))

    def look(self, dt=0.5):
        """Advance to the next look: None if it holds, else (promise, withdraw) of the batch it sends."""
        self.t += dt
        self.pace.look(self.q, self.t)
        if self.pace.may_hold(self.t, len(self.q)):
            return None
        sent = self.pace.sending(self.t)
        self.q.clear()
        return sent


def test_the_sender_holds_steps_that_keep_ending_under_a_promise_and_withdraws_it_when_they_stop():
    w = Worker(asked=0.0)
    w.step()
    assert w.look() == (0.0, False)  # at its own pace nothing is held nor promised
    w.pace.ask(2.0)
    assert w.pace.asked_s == 2.0
    # 50 ms steps: the first batch after the ask goes at once and promises the next
    w.step(0.05)
    assert w.look() == (2.0, False)
    # steps keep ending: held until the promise's time is up, then sent with a new promise
    for _ in range(3):
        w.step(0.05)
        assert w.look() is None
    w.step(0.05)
    assert w.look() == (2.0, False) and w.pace.held == 3
    # they stop: the look that finds none for 0.75 s sends (what it held, or nothing) withdrawing the promise
    w.step(0.4)
    assert w.look() is None  # the newest ended 0.4 s before this look
    assert w.look() == (0.0, True)  # 0.9 s: stopped
    assert w.look() == (0.0, False)  # said once
    # they start again: the first batch goes at once, promising again
    w.step(0.05)
    assert w.look() == (2.0, False)


def test_steps_slower_than_a_look_still_keep_ending_and_an_empty_look_renews_the_promise():
    """1.2 s steps: a look often finds nothing new, which is not a stop (1.5 intervals are allowed); when the
    promise's time is up with nothing queued, an empty batch renews it (the agent's would lapse otherwise)."""
    w = Worker()
    sent = []
    for i in range(24):  # 12 s, a step every 1.2 s (every 2.4 looks)
        ended = [k * 1.2 for k in range(11) if i * 0.5 < k * 1.2 <= (i + 1) * 0.5]
        for end in ended:
            w.step((i + 1) * 0.5 - end)
        sent.append(w.look())
    batches = [s for s in sent[4:] if s is not None]  # once the interval is learnt
    assert batches and all(s == (2.0, False) for s in batches), sent
    assert len(batches) <= 6  # about one per 2 s, never one per step and one per withdrawal


def test_a_new_stream_a_final_batch_and_asks_out_of_range_promise_nothing():
    w = Worker()
    w.step()
    assert w.look() == (2.0, False)
    w.pace.new_stream()  # a reconnect: the agent there was told nothing
    w.step()
    assert w.pace.asked_s == 0 and w.look() == (0.0, False)
    w.pace.ask(2.0)
    w.step()
    w.pace.look(w.q, w.t)
    assert w.pace.sending(w.t, final=True) == (0.0, False)  # the goodbye's batch
    for asked, applied in ((0.5, 0.0), (0.2, 0.0), (float("nan"), 0.0), (600.0, 10.0), (-1.0, 0.0)):
        w.pace.ask(asked)
        assert w.pace.asked_s == applied, asked
    # a full queue goes whatever the pace
    w.pace.ask(2.0)
    w.step()
    assert w.look() == (2.0, False)
    for _ in range(300):
        w.step()
    assert w.look() == (2.0, False)


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
    wd = _watchdog(sim, actions, tmp_path, quiet_read_period_s=6.0, quiet_after_s=10.0, quiet_step_send_s=2.0)
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
    wd2 = _watchdog(sim2, actions2, tmp_path, quiet_read_period_s=6.0, quiet_after_s=10.0, quiet_step_send_s=2.0)
    for _ in range(8):
        sim2.clock.now += 2.0
        sim2.js.record_step("j", 0, index=1, start_unix=sim2.clock.now - 1, duration_seconds=1.0)
        wd2.check_once()
    assert actions2.paces == [("j", [0, 1], 6.0)] and actions2.sends == [0.0]
    wd3 = _watchdog(Sim(ranks=2), Actions(), tmp_path)
    assert wd3._pacer._send_s == 2.0  # the default


def _promise(sim, within=2.0, ranks=None):
    for r in range(sim.ranks) if ranks is None else ranks:
        sim.js.record_steps_promise("j", r, within)


def _holding(sim, actions, tmp_path, probe="running"):
    """A watchdog that has seen the job at work, every batch promising the next within 4 s; `probe`: what every
    rank's process is when asked."""
    wd = _watchdog(sim, actions, tmp_path, probe=lambda pid: probe)
    for _ in range(5):
        sim.run(2)
        _promise(sim, 4.0)
        wd.check_once()
    return wd


def test_a_job_whose_ranks_keep_their_promises_is_not_hung_and_one_whose_ranks_stop_is_on_its_usual_deadline(
        tmp_path):
    """The deadline is 5 s here (the test's floor); the ranks hold their steps for up to 8 s (an ask of 4 s, late)."""
    sim = Sim(ranks=2)
    actions = Actions(answer={0, 1})
    wd = _holding(sim, actions, tmp_path)
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
    wd = _holding(sim, actions, tmp_path)
    sim.clock.now += 0.5
    _promise(sim, 0.0, ranks=[0])  # rank 1 is stopped: it says nothing
    wd.check_once()
    sim.clock.now += 4.9
    wd.check_once()
    assert [i.kind for i in actions.records][:1] == [IncidentKind.HANG]  # 5.4 s after the last step, not 8 s


def test_a_job_whose_every_rank_is_stopped_is_judged_once_a_promised_batch_is_overdue(tmp_path):
    """One rank (or every rank of a node) SIGSTOPped while holding its steps: no sender is left to say the steps
    stopped. Once the batch it promised is overdue (4 s and a look here), the watchdog asks the process: stopped, so
    the job is judged on its newest step (on the 5 s deadline), not when the promise lapses at 8 s."""
    sim = Sim(ranks=2)
    actions = Actions(answer=set())
    wd = _holding(sim, actions, tmp_path, probe="stopped")
    sim.clock.now += 4.4
    wd.check_once()
    assert actions.records == [] and wd._hang.stalled_s("j") == 0.0  # promised, not yet overdue: not asked
    sim.clock.now += 0.2
    wd.check_once()
    assert actions.records == [] and wd._hang.stalled_s("j") > 4.5  # overdue and stopped: the stall shows
    sim.clock.now += 0.5
    wd.check_once()
    hang = actions.records[0]
    assert hang.kind is IncidentKind.HANG and hang.evidence["stalled_seconds"] < 5.5  # 5.1 s, not 8 s
    assert hang.evidence["verdict"]["unresponsive"] == {"0": "stopped", "1": "stopped"}


def test_every_rank_silent_past_its_promise_is_judged_on_the_newest_step(tmp_path):
    """Every sender stuck at once (each rank's GIL held by a stuck native call): the promises lapse after twice
    their time, and the newest step is then older than the deadline: a hang, later by the promises' time."""
    sim = Sim(ranks=2)
    actions = Actions(answer={0, 1})
    wd = _holding(sim, actions, tmp_path)
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
    assert watchdog_config().quiet_step_send_s == 2.0  # the default
    monkeypatch.setenv(QUIET_STEP_SEND_ENV, "0")
    assert watchdog_config().quiet_step_send_s == 0.0  # never ask
    for bad in ("later", "-1", "11"):
        monkeypatch.setenv(QUIET_STEP_SEND_ENV, bad)
        with pytest.raises(ValueError, match="TRAINWARDEN_QUIET_STEP_SEND_S.*between 0 .never ask.* and 10"):
            watchdog_config()

import pickle
import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from trainwarden.agent.watchdog.hang import HangConfig
from trainwarden.agent.incidents import IncidentKind, IncidentState
from trainwarden.agent.telemetry.arrivals import Arrival
from trainwarden.agent.telemetry.job_telemetry import JobTelemetry, WorkerInfo
from trainwarden.agent.watchdog.straggler import StragglerConfig, StragglerPolicy
from trainwarden.agent.watchdog.loop import Watchdog, WatchdogConfig

pytestmark = pytest.mark.timeout(30)
STACKS = """Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/app/train.py", line 12 in data_loader

Current thread 0x00007f0000000003 (most recent call first):
  File "/app/runtime/session.py", line 180 in dump_diagnostics

Thread 0x00007f0000000001 (most recent call first):
  File "/app/runtime/faults.py", line {line} in _hang
  File "/app/train.py", line 40 in train
"""


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


class Actions:
    """Fake agent actions: ranks in `answer` write diagnostics (rank `lagging` one collective behind)."""

    def __init__(self, answer=(), lagging=None, abort_ok=True):
        self.answer, self.lagging, self.abort_ok = set(answer), lagging, abort_ok
        self.requests, self.aborts, self.records = [], [], []
        self.exclusions = {}
        self.paces = []
        self.sends = []  # the step-send period asked with each pace

    def request_diagnostics(self, job, ranks, directory):
        self.requests.append((job, list(ranks), directory))
        assert directory.is_dir()
        for r in ranks:
            if r not in self.answer:
                continue
            seq = 9 if r == self.lagging else 10
            entry = {"process_group": ("0", "default_pg"), "collective_seq_id": seq, "p2p_seq_id": 0,
                     "profiling_name": "gloo:all_reduce", "state": "scheduled", "retired": r == self.lagging,
                     "is_p2p": False}
            (directory / f"rank{r}.stacks").write_text(STACKS.format(line=100 + r))
            (directory / f"rank{r}.fr").write_bytes(pickle.dumps({"entries": [entry]}))
        return [r for r in ranks if r in self.answer]

    def abort(self, job, ranks, reason):
        self.aborts.append((job, list(ranks), reason))
        return self.abort_ok

    def record(self, incident):
        self.records.append(incident)
        return incident

    def request_exclusion(self, job, node, request):
        self.exclusions[(job, node)] = dict(request)

    def withdraw_exclusion(self, job, node):
        self.exclusions.pop((job, node), None)

    def set_read_pace(self, job, ranks, period_s, send_s=0.0):
        self.paces.append((job, list(ranks), period_s))
        self.sends.append(send_s)
        return list(ranks)


class Sim:
    def __init__(self, ranks=4, mesh=None):
        self.clock = Clock()
        self.js = JobTelemetry(clock=self.clock)
        self.ranks, self.mesh = ranks, mesh or {"dp": ranks}
        self.step = 0
        self.wait = {r: 0.0 for r in range(ranks)}
        self.connect(pid_base=100)

    def connect(self, pid_base):
        self.seq = 0  # collective sequence ids start again with every worker round
        for r in range(self.ranks):
            self.js.connect(WorkerInfo(job="j", rank=r, local_rank=r, world_size=self.ranks, mesh=self.mesh,
                                       pid=pid_base + r, hostname=f"host{r}"))

    def run(self, steps, compute=None, after=0.05):
        """`steps` steps of one all-reduce each: rank r computes compute[r] (0.2 s by default) and arrives;
        all depart when the last arrives, compute `after` seconds more, and the next step starts. Steps and
        arrivals are sent once per call, like the runtime's batched reads."""
        compute = compute or {}
        arrivals = {r: [] for r in range(self.ranks)}
        for _ in range(steps):
            start = self.clock.now
            cs = {r: compute.get(r, 0.2) for r in range(self.ranks)}
            for r in range(self.ranks):
                arrivals[r].append(Arrival("0", self.seq, int((start + cs[r]) * 1e9)))
            self.seq += 1
            dt = max(cs.values()) + after
            self.clock.now += dt
            self.step += 1
            for r in range(self.ranks):
                self.js.record_step("j", r, index=self.step, start_unix=start, duration_seconds=dt)
        for r in range(self.ranks):
            self.js.record_arrivals("j", r, arrivals[r], continues=True, members={"0": range(self.ranks)})


def _watchdog(sim, actions, tmp_path, probe=lambda pid: "stopped", **config):
    cfg = WatchdogConfig(hang=HangConfig(startup_s=30, warmup_steps=3, floor_s=5.0), **config)
    return Watchdog(sim.js, actions, node="n1", config=cfg, clock=sim.clock, wall=sim.clock,
                    sleep=sim.clock.sleep, probe=probe, diagnostics_dir=lambda job: tmp_path / job)


def _steady(sim, wd, checks=10):
    """A healthy job the watchdog has seen at work: ``checks`` checks of two steps each."""
    for _ in range(checks):
        sim.run(2)
        wd.check_once()


def _flags(sim):
    return {r.rank: r.flags for r in sim.js.snapshot("j")[0].ranks}


def test_hang_names_culprit_records_aborts_and_resolves_after_restart(tmp_path):
    sim = Sim()
    actions = Actions(answer={0, 1, 3}, lagging=1)
    wd = _watchdog(sim, actions, tmp_path)
    _steady(sim, wd)
    sim.clock.now += 4.5
    wd.check_once()
    assert actions.requests == []
    sim.clock.now += 1.0
    wd.check_once()
    (job, ranks, directory), = actions.requests
    assert (job, ranks) == ("j", [0, 1, 2, 3]) and directory.parent == tmp_path / "j"
    opened, acting = actions.records
    assert opened.kind is IncidentKind.HANG and opened.state is IncidentState.OPEN and opened.ranks == (1,)
    verdict = opened.evidence["verdict"]
    assert verdict["culprits"] == [1] and verdict["unresponsive"] == {"2": "stopped"}
    assert verdict["stacks"]["1"][0] == "_hang (/app/runtime/faults.py:101)"
    assert opened.evidence["timeout_seconds"] == 5 and opened.evidence["diagnostics_dir"] == str(directory)
    assert acting.id == opened.id and acting.state is IncidentState.ACTING
    (_, aborted, reason), = actions.aborts
    assert aborted == [0, 1, 2, 3] and "rank 1 never entered all_reduce #10" in reason
    assert reason.startswith("hang: no step or collective for 5.") and " s; " in reason  # not rounded to 5 s
    assert "hung" in _flags(sim)[1]
    # torchrun restarts the workers; nothing fires again while they start, then they progress
    for r in range(4):
        sim.js.disconnect("j", r, 100 + r)
    sim.clock.now += 10
    wd.check_once()
    sim.connect(pid_base=200)
    sim.clock.now += 20
    wd.check_once()
    sim.run(3)
    wd.check_once()
    assert len(actions.aborts) == 1
    resolved = actions.records[-1]
    assert resolved.id == opened.id and resolved.state is IncidentState.RESOLVED
    assert "progressed again" in resolved.outcome
    assert "hung" not in _flags(sim)[1]


def test_a_hang_is_timed_from_the_last_steps_end_when_its_report_arrives_late(tmp_path):
    sim = Sim(ranks=2)
    actions = Actions(answer={0, 1})
    wd = _watchdog(sim, actions, tmp_path)
    for _ in range(5):
        sim.run(2)
        wd.check_once()
    sim.run(2)  # the last steps before the hang: their batch reaches the agent 0.8 s after they ended
    sim.clock.now += 0.8
    wd.check_once()
    sim.clock.now += 4.1
    wd.check_once()
    assert actions.records == []
    sim.clock.now += 0.2
    wd.check_once()
    assert actions.records[0].kind is IncidentKind.HANG  # 5.1 s after the last step ended, not 5.9 s
    # a wall clock stepped far ahead makes no hang of a fresh report (on the default 2 s floor): its age counts
    # 1 s at most
    sim2 = Sim(ranks=2)
    actions2 = Actions(answer={0, 1})
    skew = lambda: sim2.clock() + 3600.0
    wd2 = Watchdog(sim2.js, actions2, node="n1", config=WatchdogConfig(hang=HangConfig(startup_s=30, warmup_steps=3)),
                   clock=sim2.clock, wall=skew, sleep=sim2.clock.sleep, probe=lambda pid: "stopped",
                   diagnostics_dir=lambda job: tmp_path / "skew")
    for _ in range(10):
        sim2.run(2)
        wd2.check_once()
        sim2.clock.now += 1.0
    assert actions2.records == []


def test_collectives_a_slow_read_reports_late_count_from_when_they_were_entered(tmp_path):
    """A quiet job's ranks read their Flight Recorders every 6 s. After the hang, the ranks waiting for the stuck one
    had entered one more collective, and the next read reported it 4 s later. It is progress from when it was
    entered, not from 1 s before the read (the soak's SIGSTOP that one node judged 5.9 s after the other)."""
    sim = Sim(ranks=2)
    actions = Actions(answer={0, 1})
    wd = _watchdog(sim, actions, tmp_path, quiet_read_period_s=6.0, quiet_after_s=10.0)
    _steady(sim, wd, checks=25)
    assert actions.paces[-1][2] == 6.0  # read slowly
    sim.run(2)
    wd.check_once()
    last_step_end = sim.clock.now
    entered = int((last_step_end + 0.1) * 1e9)
    sim.clock.now += 4.0  # the slow read, 3.9 s after they entered
    for r in range(2):
        sim.js.record_arrivals("j", r, [Arrival("0", sim.seq, entered)], continues=True, members={"0": range(2)})
    wd.check_once()
    sim.clock.now = last_step_end + 5.0
    wd.check_once()
    assert actions.records == []
    sim.clock.now = last_step_end + 5.2
    wd.check_once()
    assert [i.kind for i in actions.records][:1] == [IncidentKind.HANG]  # 5.1 s after they entered, not 8.2 s


def test_held_steps_reported_when_they_stop_count_from_their_end(tmp_path):
    """Held steps (runtime/send_pace.py): a rank whose steps stop says so at its first look 1.5 step intervals
    later, 2.3 s after its last step for steps of 1.25 s. The hang is timed from that step's end, not from 1 s
    before the batch arrived."""
    sim = Sim(ranks=2)
    actions = Actions(answer={0, 1})
    wd = _watchdog(sim, actions, tmp_path, quiet_read_period_s=6.0, quiet_after_s=10.0, quiet_step_send_s=2.0)
    slow = {0: 1.2, 1: 1.2}
    for _ in range(12):
        sim.run(2, compute=slow)
        for r in range(2):
            sim.js.record_steps_promise("j", r, 2.0)
        wd.check_once()
    assert actions.sends[-1] == 2.0
    deadline = HangConfig(startup_s=30, warmup_steps=3, floor_s=5.0).steady_timeout(1.25)
    sim.run(1, compute=slow)  # the last step: held, its batch comes with the withdrawal
    last_step_end = sim.clock.now
    sim.clock.now += 2.3  # the first check that hears of it
    for r in range(2):
        sim.js.record_steps_promise("j", r, 0.0)
    wd.check_once()
    sim.clock.now = last_step_end + deadline - 0.2
    wd.check_once()
    assert actions.records == []
    sim.clock.now = last_step_end + deadline + 0.1
    wd.check_once()
    assert [i.kind for i in actions.records][:1] == [IncidentKind.HANG]


def test_a_node_whose_ranks_changed_with_the_world_names_only_its_ranks_of_now(tmp_path):
    """The soak: n0 ran ranks 0-3, waited out a round, and joined the grown job as ranks 4-7. Its next hang named
    ranks 0-3 too ("rank 0 is dead (its process is gone)"): the store still held them, and the probe of their old
    pids said dead. Ranks this node held in an earlier worker round and holds no more are not its now."""
    clock = Clock()
    js = JobTelemetry(clock=clock)
    actions = Actions(answer={4, 5, 6, 7})
    wd = Watchdog(js, actions, node="n0", config=WatchdogConfig(hang=HangConfig(startup_s=30, warmup_steps=3,
                                                                                floor_s=5.0)),
                  clock=clock, wall=clock, sleep=clock.sleep, probe=lambda pid: "dead",
                  diagnostics_dir=lambda job: tmp_path / job)

    def round_of(ranks, restart_count, pid_base, steps):
        for r in ranks:
            js.connect(WorkerInfo(job="j", rank=r, local_rank=r % 4, world_size=8, mesh={"dp": 8},
                                  pid=pid_base + r, hostname="n0", restart_count=restart_count))
        for i in range(steps):
            start = clock.now
            clock.now += 0.25
            for r in ranks:
                js.record_step("j", r, index=i + 1, start_unix=start, duration_seconds=0.25)
            wd.check_once()

    round_of(range(4), 0, 100, 20)
    for r in range(4):
        js.disconnect("j", r, 100 + r)
    clock.now += 10
    wd.check_once()
    round_of(range(4, 8), 0, 200, 20)
    assert sorted(r.rank for r in js.snapshot("j")[0].ranks) == [4, 5, 6, 7]
    clock.now += 6
    wd.check_once()
    hang = actions.records[0]
    assert hang.kind is IncidentKind.HANG
    assert set(hang.evidence["verdict"].get("unresponsive", {})) <= {"4", "5", "6", "7"}
    assert "rank 0" not in hang.evidence["verdict"]["summary"]
    (_, aborted, _), = actions.aborts
    assert aborted == [4, 5, 6, 7]
    # a rank of this round whose stream dropped (a SIGSTOPped rank's may) is still probed: it is the job's; so is one
    # of a group that restarts in place, until its new process connects
    js.disconnect("j", 5, 205)
    assert 5 in [r.rank for r in js.snapshot("j")[0].ranks]
    js.disconnect("j", 4, 204)
    js.connect(WorkerInfo(job="j", rank=4, local_rank=0, world_size=8, mesh={"dp": 8}, pid=304, hostname="n0"))
    assert sorted(r.rank for r in js.snapshot("j")[0].ranks) == [4, 5, 6, 7]


def test_failed_abort_marks_the_incident_failed(tmp_path):
    sim = Sim(ranks=2)
    actions = Actions(answer={0, 1}, abort_ok=False)
    wd = _watchdog(sim, actions, tmp_path)
    wd.check_once()  # the watchdog sees the round start
    sim.run(10)
    wd.check_once()
    sim.clock.now += 6
    wd.check_once()
    assert [i.state for i in actions.records] == [IncidentState.OPEN, IncidentState.ACTING, IncidentState.FAILED]
    assert actions.records[0].evidence["verdict"]["summary"].startswith("no lagging rank: every rank is inside")


def test_record_only_does_not_abort(tmp_path):
    sim = Sim(ranks=2)
    actions = Actions(answer={0, 1}, lagging=0)
    wd = _watchdog(sim, actions, tmp_path, abort_on_hang=False)
    wd.check_once()
    sim.run(10)
    wd.check_once()
    sim.clock.now += 6
    wd.check_once()
    assert actions.aborts == [] and [i.state for i in actions.records] == [IncidentState.OPEN]


def test_straggler_start_and_end_flag_record_and_export(tmp_path):
    sim = Sim(ranks=4)
    actions = Actions()
    cfg = StragglerConfig(window_steps=20, persist_steps=3, clear_persist_steps=3, policy=StragglerPolicy.EXCLUDE)
    wd = _watchdog(sim, actions, tmp_path, straggler=cfg)
    slow = {3: 0.25}   # rank 3 computes 0.30 s a step, its peers 0.25 s: it scores 1.2
    for _ in range(15):
        sim.run(7, compute=slow)
        wd.check_once()
    start, = actions.records
    assert start.kind is IncidentKind.STRAGGLER_START and start.ranks == (3,)
    assert start.evidence["score"] == pytest.approx(1.2, rel=0.02) and start.evidence["policy"] == "exclude"
    assert "exclude node host3" in start.action
    assert start.evidence["summary"].startswith("rank 3 has been busy 100% of its time against its peers' 83%")
    request = actions.exclusions[("j", "n1")]
    assert request["rank"] == 3 and request["incident"] == start.id and "straggler" in request["reason"]
    assert "straggler" in _flags(sim)[3]
    assert sim.js.snapshot("j")[0].ranks[3].straggler_score == pytest.approx(1.2, rel=0.02)  # for `status`
    registry = CollectorRegistry()
    registry.register(wd.collector())
    text = generate_latest(registry).decode()
    assert 'trainwarden_straggler{job="j",node="n1",rank="3"} 1.0' in text
    assert 'trainwarden_straggler{job="j",node="n1",rank="0"} 0.0' in text
    score = next(line for line in text.splitlines()
                 if line.startswith('trainwarden_straggler_score{job="j",node="n1",rank="3"}'))
    assert float(score.split()[-1]) == pytest.approx(1.2, rel=0.02)
    assert 'trainwarden_hang_timeout_seconds{job="j",node="n1"} 5.0' in text
    for _ in range(15):
        sim.run(7)
        wd.check_once()
    _, end, resolved = actions.records
    assert end.kind is IncidentKind.STRAGGLER_END and end.state is IncidentState.RESOLVED
    assert resolved.id == start.id and resolved.state is IncidentState.RESOLVED
    assert actions.exclusions == {}   # recovered before a restart: the request is withdrawn
    assert "straggler" not in _flags(sim)[3]


def test_a_straggler_still_flagged_when_the_agent_stops_is_closed_not_left_open(tmp_path):
    sim = Sim(ranks=4)
    actions = Actions()
    wd = _watchdog(sim, actions, tmp_path, straggler=StragglerConfig(window_steps=10, persist_steps=3))
    for _ in range(10):
        sim.run(7, compute={2: 0.3})
        wd.check_once()
    start, = actions.records
    wd.start()
    assert wd.stop()
    closed = actions.records[-1]
    assert closed.id == start.id and closed.state is IncidentState.RESOLVED and "agent stopped" in closed.outcome


def test_pipeline_stages_are_scored_separately(tmp_path):
    sim = Sim(ranks=4, mesh={"pp": 2, "dp": 2})
    actions = Actions()
    wd = _watchdog(sim, actions, tmp_path, straggler=StragglerConfig(window_steps=20))
    for _ in range(15):
        sim.run(7, compute={0: 0.1, 1: 0.1, 2: 0.25, 3: 0.25})  # stage 1 is heavier by design
        # (one all-reduce over all four ranks: stage 0 waits for stage 1 and is never compared to it)
        wd.check_once()
    assert actions.records == []


def test_workers_read_slowly_while_no_straggler_is_near_and_at_their_own_pace_once_one_is(tmp_path):
    sim = Sim(ranks=4)
    actions = Actions()
    wd = _watchdog(sim, actions, tmp_path, straggler=StragglerConfig(window_steps=10, persist_steps=5),
                   quiet_read_period_s=3.0, quiet_after_s=10.0)
    for _ in range(8):  # a balanced job: 8 x 1.75 s
        sim.run(7)
        wd.check_once()
    # nothing was near a decision for 10 s: every worker is asked once to read at most every 3 s
    assert actions.paces == [("j", [0, 1, 2, 3], 3.0)]
    registry = CollectorRegistry()
    registry.register(wd.collector())
    assert 'trainwarden_flight_recorder_read_pace_seconds{job="j",node="n1"} 3.0' in generate_latest(registry).decode()
    # collectives are heard once a read, then a flush: the collectives deadline allows for the slow pace
    assert wd._pacer.collective_report_s("j") == 3.0 + 0.5
    # rank 2 turns slow (1.2x): its first slices bring every worker back to its own pace, before the flag
    sim.run(5, compute={2: 0.3})
    wd.check_once()
    assert actions.paces[1:] == [("j", [0, 1, 2, 3], 0.0)] and actions.records == []
    assert wd._pacer.collective_report_s("j") == 3.0 + 0.5  # a read at the slow pace may still be due
    for _ in range(10):
        sim.run(7, compute={2: 0.3})
        wd.check_once()
    assert wd._pacer.collective_report_s("j") == 1.5 + 0.5  # the workers' own pace
    assert [i.kind for i in actions.records] == [IncidentKind.STRAGGLER_START]
    assert len(actions.paces) == 2  # told once; nothing repeated while it stays so
    # the straggler recovers and the flag clears: 10 s later the workers read slowly again
    for _ in range(20):
        sim.run(7)
        wd.check_once()
    assert IncidentKind.STRAGGLER_END in [i.kind for i in actions.records]
    assert actions.paces[-1] == ("j", [0, 1, 2, 3], 3.0)
    # a stream that reconnects (same process) starts at the worker's own pace again: it is told again
    sim.js.disconnect("j", 1, 101)
    sim.js.connect(WorkerInfo(job="j", rank=1, local_rank=1, world_size=4, mesh=sim.mesh, pid=101, hostname="host1"))
    sim.run(7)
    wd.check_once()
    assert actions.paces[-1] == ("j", [1], 3.0)
    del actions.paces[-1]
    # a new worker round starts at its own pace: only the new processes are told
    for r in range(4):
        sim.js.disconnect("j", r, 100 + r)
    sim.connect(pid_base=200)
    sim.run(7)
    wd.check_once()
    assert actions.paces[-1] == ("j", [0, 1, 2, 3], 3.0) and len(actions.paces) == 4


def test_workers_read_at_their_own_pace_while_a_communication_regression_is_near_a_decision(tmp_path):
    """On gloo a slow window's collective wait reaches the agent with the next Flight Recorder read: at the quiet
    pace a degraded link is judged a read later (issue 47's 30 s), so a slow window brings the reads back too."""
    sim = Sim(ranks=4)
    actions = Actions()
    wd = _watchdog(sim, actions, tmp_path, quiet_read_period_s=6.0, quiet_after_s=10.0)
    for _ in range(8):
        sim.run(7)
        wd.check_once()
    assert actions.paces == [("j", [0, 1, 2, 3], 6.0)]
    assert wd._pacer.collective_report_s("j") == 6.0 + 0.5
    near = {"j"}
    wd._comm.detector.near_decision = lambda job: job in near  # the detector's side: test_comm_regression.py
    sim.run(7)
    wd.check_once()
    assert actions.paces[-1] == ("j", [0, 1, 2, 3], 0.0)
    near.clear()
    for _ in range(8):
        sim.run(7)
        wd.check_once()
    assert actions.paces[-1] == ("j", [0, 1, 2, 3], 6.0) and len(actions.paces) == 3


def test_read_pacing_can_be_turned_off(tmp_path):
    sim = Sim(ranks=2)
    actions = Actions()
    wd = _watchdog(sim, actions, tmp_path, quiet_read_period_s=0)
    for _ in range(10):
        sim.run(7)
        wd.check_once()
    assert actions.paces == []


class FlakyJobState:
    def __init__(self):
        self.calls = 0
        self.seen_after_error = threading.Event()

    def snapshot(self, job=None):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("bad iteration")
        self.seen_after_error.set()
        return ()


def test_loop_survives_a_bad_iteration_and_stops(tmp_path):
    js = FlakyJobState()
    wd = Watchdog(js, Actions(), node="n1", config=WatchdogConfig(interval_s=0.01),
                  diagnostics_dir=lambda job: tmp_path)
    wd.start()
    try:
        assert js.seen_after_error.wait(10)
    finally:
        assert wd.stop(timeout=5)
    assert wd.errors == 1
    with pytest.raises(ValueError, match="interval_s"):
        WatchdogConfig(interval_s=0)


def test_a_silent_stopped_rank_that_the_others_wait_for_is_named(tmp_path):
    sim = Sim(ranks=4)
    actions = Actions(answer={0, 2, 3})  # rank 1 is SIGSTOPped: it cannot answer; the others wait
    wd = _watchdog(sim, actions, tmp_path)
    wd.check_once()
    sim.run(10)
    wd.check_once()
    sim.clock.now += 6
    wd.check_once()
    opened = actions.records[0]
    verdict = opened.evidence["verdict"]
    assert verdict["culprits"] == [1] and verdict["unresponsive"] == {"1": "stopped"}
    assert verdict["summary"].startswith("rank 1 is stopped"), verdict["summary"]
    assert opened.ranks == (1,)


def test_a_stopped_rank_whose_stream_was_dropped_is_still_named_stopped(tmp_path):
    """Seen in CI: the stopped rank's telemetry stream ended before the hang was declared, and the verdict
    said it "lost its telemetry stream" instead of "is stopped"; the process state is the better witness."""
    sim = Sim(ranks=4)
    actions = Actions(answer={0, 2, 3})
    wd = _watchdog(sim, actions, tmp_path)
    wd.check_once()
    sim.run(10)
    wd.check_once()
    sim.js.disconnect("j", 1, 101)
    sim.clock.now += 6
    wd.check_once()
    verdict = actions.records[0].evidence["verdict"]
    assert verdict["unresponsive"] == {"1": "stopped"} and verdict["summary"].startswith("rank 1 is stopped")


def test_the_abort_follows_the_last_ranks_diagnostics_without_a_further_wait(tmp_path):
    """Each rank's dumps appear whole (written under a temporary name, then renamed): once every rank's trace is
    there, the watchdog aborts. It used to sleep one more poll (0.1 s) "for the last writes" on every hang."""
    sim = Sim(ranks=2)
    asked_at, aborted_at = [], []

    class Timed(Actions):
        def request_diagnostics(self, job, ranks, directory):
            asked_at.append(sim.clock.now)
            return super().request_diagnostics(job, ranks, directory)

        def abort(self, job, ranks, reason):
            aborted_at.append(sim.clock.now)
            return super().abort(job, ranks, reason)

    actions = Timed(answer={0, 1})
    wd = _watchdog(sim, actions, tmp_path)
    for _ in range(5):
        sim.run(2)
        wd.check_once()
    sim.clock.now += 5.1
    wd.check_once()
    assert asked_at and aborted_at == asked_at  # the dumps were there at the first look


def test_a_hang_after_a_checkpoint_write_is_judged_by_the_steps_the_write_did_not_slow(tmp_path):
    """Seen in tests/bench/bench_hang.py (issue 26): the reference job's steps took 0.2-0.3 s, the two after each
    save 0.35 and 0.61 s (the background write shares 2 cores with 8 ranks), and a hang five steps after the
    write's commit got a 3.7 s deadline (5 x the p99 of a window that held them) instead of the 2 s floor. Those
    steps now count only while a write may slow the step in flight."""

    def write(sim, stage, step):
        for r in range(sim.ranks):
            sim.js.record_checkpoint("j", r, stage=stage, step=step, seconds=0.0)

    def job_with_a_save(tmp, end_write):
        sim = Sim(ranks=2)
        actions = Actions(answer={0, 1})
        wd = Watchdog(sim.js, actions, node="n1", config=WatchdogConfig(hang=HangConfig(
            startup_s=30, warmup_steps=3, floor_s=1.0)), clock=sim.clock, wall=sim.clock, sleep=sim.clock.sleep,
            probe=lambda pid: "stopped", diagnostics_dir=lambda job: tmp / job)
        wd.check_once()
        sim.run(8)  # 0.25 s steps
        wd.check_once()
        write(sim, "save_start", 8)
        write(sim, "staged", 8)
        sim.run(2, compute={0: 0.8, 1: 0.8})  # 0.85 s steps while the write runs
        wd.check_once()
        if end_write:
            write(sim, "written", 8)
            sim.run(1, compute={0: 0.6, 1: 0.6})  # the step in which it ended
            sim.run(3)
            wd.check_once()
        return sim, wd, actions

    def deadline(tmp, end_write, quiet_s):
        """The deadline of a hang: none within `quiet_s` of quiet, one 0.1 s later."""
        sim, wd, actions = job_with_a_save(tmp, end_write)
        sim.clock.now += quiet_s
        wd.check_once()
        assert actions.records == []
        sim.clock.now += 0.1
        wd.check_once()
        assert actions.records and actions.records[0].kind is IncidentKind.HANG
        return actions.records[0].evidence["timeout_seconds"]

    assert deadline(tmp_path / "after", True, 1.2) == pytest.approx(1.25)  # 5 x 0.25 s, not 5 x 0.85 s
    # a hang while a write is in flight allows for the steps the write slows
    assert deadline(tmp_path / "during", False, 4.2) == pytest.approx(4.25)


def test_a_rank_whose_reports_stopped_in_its_start_up_does_not_stretch_the_steady_deadline(tmp_path):
    """Seen in tests/integration/test_unchanged_scripts.py: a rank's telemetry stops with the rank, so the
    steps of its last flush interval (1.5 s) never arrive; stopped a second into training, it had reported only
    its 4.6 s first step, and the job's deadline became 5 x that (23 s) although rank 0 reported 0.1 s steady
    steps. The ranks that report steady steps set the deadline; start-up steps only while none does."""
    sim = Sim(ranks=2)
    actions = Actions(answer={0})
    wd = _watchdog(sim, actions, tmp_path)

    def step(ranks, index, duration):
        start = sim.clock.now
        sim.clock.now += duration
        for r in ranks:
            sim.js.record_step("j", r, index=index, start_unix=start, duration_seconds=duration)

    wd.check_once()
    step((0, 1), 0, 4.0)  # the first step: start-up
    wd.check_once()
    for index in range(1, 13):  # rank 1's reports of these never arrive
        step((0,), index, 0.1)
        wd.check_once()
    sim.clock.now += 4.9
    wd.check_once()
    assert actions.records == []
    sim.clock.now += 0.2
    wd.check_once()
    assert actions.records and actions.records[0].kind is IncidentKind.HANG
    assert actions.records[0].evidence["timeout_seconds"] == 5
    # while no rank has steady steps, the start-up steps still hold the deadline (a job of long steps)
    sim2 = Sim(ranks=2)
    actions2 = Actions(answer={0})
    wd2 = _watchdog(sim2, actions2, tmp_path / "long")
    wd2.check_once()
    sim = sim2
    for index in range(4):
        step((0, 1), index, 4.0)
        wd2.check_once()
    sim2.clock.now += 19.9
    wd2.check_once()
    assert actions2.records == []


def test_a_flapping_straggler_is_rate_limited_per_job_and_counted(tmp_path):
    sim = Sim(ranks=4)
    actions = Actions()
    cfg = StragglerConfig(window_steps=10, persist_steps=3, clear_persist_steps=3, min_flag_s=0.0,
                          max_incidents_per_hour=2)
    wd = _watchdog(sim, actions, tmp_path, straggler=cfg)
    for _ in range(4):  # rank 3 slow, then back in line, four times within the hour
        for _ in range(8):
            sim.run(7, compute={3: 0.3})
            wd.check_once()
        for _ in range(8):
            sim.run(7)
            wd.check_once()
    kinds = [(i.kind, i.state) for i in actions.records if i.kind is IncidentKind.STRAGGLER_START
             and i.state is IncidentState.OPEN]
    assert len(kinds) == 2, [i.kind for i in actions.records]
    assert len([i for i in actions.records if i.kind is IncidentKind.STRAGGLER_END]) == 2
    assert wd.suppressed == {"j": 2}
    registry = CollectorRegistry()
    registry.register(wd.collector())
    assert 'trainwarden_straggler_incidents_suppressed_total{job="j",node="n1"} 2.0' in \
        generate_latest(registry).decode()


def test_one_open_straggler_incident_per_rank(tmp_path):
    from trainwarden.agent.watchdog.straggler import RankScore, StragglerEvent

    sim = Sim(ranks=4)
    actions = Actions()
    wd = _watchdog(sim, actions, tmp_path)
    score = RankScore(rank=2, score=1.3, compute_share=0.9, peer_compute_share=0.7, window_seconds=7.0, slices=14,
                      flagged=True)
    event = StragglerEvent(job="j", rank=2, started=True, score=score, evaluations=7, seconds=3.5,
                           policy=StragglerPolicy.ALERT)
    snap = sim.js.snapshot("j")[0]
    wd._straggler_incidents.on_event(snap, event)
    wd._straggler_incidents.on_event(snap, event)  # the detector lost its state (a pruned job came back) and flags again
    assert [i.kind for i in actions.records] == [IncidentKind.STRAGGLER_START]
    assert wd.suppressed == {"j": 1}


def test_a_long_restore_that_reads_is_not_aborted_and_one_that_stops_reading_is(tmp_path):
    """The watchdog reads each rank's /proc/<pid>/io while it is in a blocking checkpoint stage."""
    sim = Sim(ranks=2)
    actions = Actions()
    moved = {100: 0, 101: 0}
    cfg = WatchdogConfig(hang=HangConfig(startup_s=30, warmup_steps=3, checkpoint_s=60))
    wd = Watchdog(sim.js, actions, node="n1", config=cfg, clock=sim.clock, wall=sim.clock,
                  sleep=sim.clock.sleep, probe=lambda pid: "no_answer", io_bytes=moved.get,
                  diagnostics_dir=lambda job: tmp_path / "j")
    sim.run(10)
    wd.check_once()
    for r in range(2):
        sim.js.record_checkpoint("j", r, stage="restore_start", step=10, seconds=0.0)
    for _ in range(20):  # ten minutes of restore, 8 MiB read per rank every 30 s
        sim.clock.now += 30
        for pid in moved:
            moved[pid] += 8 << 20
        wd.check_once()
    assert actions.records == []
    sim.clock.now += 61  # then the storage stops answering
    wd.check_once()
    hangs = [r for r in actions.records if r.kind is IncidentKind.HANG]
    assert len({h.id for h in hangs}) == 1
    assert hangs[0].evidence["deadline"] == "checkpoint" and hangs[0].evidence["stalled_seconds"] == 61


def test_ranks_held_for_a_membership_change_are_not_hung_but_one_that_stops_short_of_the_hold_is(tmp_path):
    """Before the job grows every rank saves after one step and holds until the launcher restarts it: a pause
    the launcher owns. A rank that never reaches the hold while the others wait is a hang as before."""
    sim = Sim(ranks=3)
    actions = Actions()
    wd = _watchdog(sim, actions, tmp_path)
    wd.check_once()  # the watchdog sees the round start
    sim.run(10)
    wd.check_once()
    for r in range(3):
        sim.js.record_checkpoint("j", r, stage="held", step=10, seconds=0.0)
    for _ in range(12):  # a minute held: no incident
        sim.clock.now += 5
        wd.check_once()
    assert actions.records == []
    sim.run(2)  # the hold limit passed and they train on: the stage clears with the first step
    wd.check_once()
    assert {r.checkpoint_stage for r in sim.js.snapshot("j")[0].ranks} == {""}
    for r in (0, 1):  # two held; rank 2 stopped before it got there
        sim.js.record_checkpoint("j", r, stage="held", step=12, seconds=0.0)
    sim.clock.now += 6
    wd.check_once()
    assert [r.kind for r in actions.records][:1] == [IncidentKind.HANG]


def test_workers_a_fenced_launcher_stops_are_not_recorded_as_a_hang_and_the_next_round_is_judged(tmp_path):
    """The soak's partition: n1's launcher, cut off from etcd, stops its workers (a fence) while they stall
    waiting for the other side; the watchdog saw them stalled and dying and recorded a hang of all its ranks
    beside the fence. A stand-down holds the round's hang; the next round is judged as before."""
    sim = Sim()
    actions = Actions(answer={0, 1, 3}, lagging=1)
    wd = _watchdog(sim, actions, tmp_path)
    _steady(sim, wd)
    sim.clock.now += 3.0
    wd.check_once()
    wd.stand_down("j", "fenced: lost etcd 12 s ago")
    for _ in range(6):  # a minute of its ranks stalled while they are stopped: nothing
        sim.clock.now += 10
        wd.check_once()
    assert actions.records == [] and actions.requests == [] and actions.aborts == []
    for r in range(4):
        sim.js.disconnect("j", r, 100 + r)
    sim.connect(pid_base=200)  # the node rejoins: a new worker round, judged again
    wd.check_once()
    sim.run(5)
    wd.check_once()
    sim.clock.now += 6.0
    wd.check_once()
    assert [r.kind for r in actions.records][:1] == [IncidentKind.HANG]


def test_a_stand_down_that_arrives_while_the_diagnostics_are_read_records_nothing(tmp_path):
    sim = Sim()
    wd = None

    class StoppingWhileAsked(Actions):
        def request_diagnostics(self, job, ranks, directory):
            wd.stand_down(job, "stopped: SIGTERM")
            return super().request_diagnostics(job, ranks, directory)

    actions = StoppingWhileAsked(answer={0, 1, 3}, lagging=1)
    wd = _watchdog(sim, actions, tmp_path)
    _steady(sim, wd)
    sim.clock.now += 6.0
    wd.check_once()
    assert len(actions.requests) == 1 and actions.records == [] and actions.aborts == []


def test_process_io_bytes_reads_a_real_process():
    import subprocess
    import sys

    from trainwarden.agent.watchdog.culprit import process_io_bytes

    child = subprocess.Popen([sys.executable, "-c", "import sys\nsys.stdin.readline()\n"
                              "open('/dev/null', 'wb').write(b'x' * (4 << 20))\nsys.stdin.readline()\n"],
                             stdin=subprocess.PIPE)
    try:
        before = process_io_bytes(child.pid)
        child.stdin.write(b"go\n")
        child.stdin.flush()
        for _ in range(200):
            after = process_io_bytes(child.pid)
            if after - before >= 4 << 20:
                break
            threading.Event().wait(0.05)
        assert after - before >= 4 << 20
    finally:
        child.stdin.close()
        child.wait(10)
    assert process_io_bytes(child.pid) is None


def test_process_cpu_seconds_counts_the_work_of_a_waiting_process_children():
    """A rank waiting for its DataLoader's workers uses no CPU itself; its children do, and that is work."""
    import subprocess
    import sys

    from trainwarden.agent.watchdog.culprit import process_cpu_seconds

    spin = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\n"
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys\nsys.stdin.readline()\n"
                               f"child = subprocess.Popen([sys.executable, '-c', {spin!r}])\n"
                               "sys.stdin.readline()\nchild.wait()\n"], stdin=subprocess.PIPE)
    try:
        threading.Event().wait(0.3)
        before = process_cpu_seconds(parent.pid)
        parent.stdin.write(b"go\n")
        parent.stdin.flush()
        during = before
        for _ in range(100):  # while the child spins, the parent blocks in readline()
            threading.Event().wait(0.05)
            during = max(during, process_cpu_seconds(parent.pid) or 0.0)
            if during - before >= 0.4:
                break
        assert during - before >= 0.4
        parent.stdin.write(b"done\n")
        parent.stdin.flush()
        threading.Event().wait(1.0)
        after = process_cpu_seconds(parent.pid)  # the child ended and was reaped: its time stays counted
        assert after is not None and after >= during - 0.05
    finally:
        parent.stdin.close()
        parent.wait(10)
    assert process_cpu_seconds(parent.pid) is None


class FakeCoordinator:
    """Stands for the job's other nodes (agent/etcd/cluster.py HangCoordinator): ``owner`` None: this node wins
    and ``others`` are the other nodes' verdicts; else that node records the hang."""

    def __init__(self, owner=None, others=None, fail=False, busy=(), awaited=None, actions=None):
        self.owner, self.others, self.fail = owner, others or {}, fail
        # a node whose verdict the owner waits for and never gets (cut off); `actions`: to see what the wait saw
        self.awaited, self.actions, self.aborts_when_waited = awaited, actions, None
        self.calls = []
        self.busy = list(busy)  # the other nodes whose ranks work (their busy beacons)
        self.said: list[bool] = []  # what this node said of its own ranks, one entry per change

    def set_busy(self, job, busy):
        if self.fail:
            raise ConnectionError("etcd unreachable")
        if not self.said or self.said[-1] != busy:
            self.said.append(busy)

    def busy_elsewhere(self, job):
        if self.fail:
            raise ConnectionError("etcd unreachable")
        return list(self.busy)

    slow_off_links: tuple = ()  # the other nodes whose latest window was slow off the links

    def set_slow_off_links(self, job, slow):
        if self.fail:
            raise ConnectionError("etcd unreachable")

    def slow_off_links_elsewhere(self, job):
        if self.fail:
            raise ConnectionError("etcd unreachable")
        return list(self.slow_off_links)

    def coordinate(self, job, key, incident_id, local, *, on_wait=None):
        self.calls.append((job, key, local))
        if self.fail:
            raise ConnectionError("etcd unreachable")
        if self.owner:
            return False, {"node": self.owner, "incident": "20261123T000000000Z-abcdef"}
        verdicts = {"n1": {**local, "node": "n1"}, **self.others}
        if self.awaited is not None and on_wait is not None:
            on_wait(dict(verdicts))
            self.aborts_when_waited = list(self.actions.aborts)  # what had been done before the wait's end
        self.unanswered = [self.awaited] if self.awaited else []
        return True, verdicts


def _hang(sim, wd):
    for _ in range(5):
        sim.run(2)
        wd.check_once()
    sim.clock.now += 6
    wd.check_once()


def test_a_hang_seen_on_several_nodes_is_recorded_once_by_the_node_that_owns_it(tmp_path):
    sim, actions = Sim(ranks=2), Actions(answer={0, 1})
    cluster = FakeCoordinator(owner="n0")
    wd = Watchdog(sim.js, actions, node="n1", config=WatchdogConfig(hang=HangConfig(startup_s=30, warmup_steps=3)),
                  clock=sim.clock, wall=sim.clock, sleep=sim.clock.sleep, probe=lambda pid: "stopped",
                  diagnostics_dir=lambda job: tmp_path / job, cluster=cluster)
    _hang(sim, wd)
    assert actions.records == []  # n0 records it
    (_, ranks, reason), = actions.aborts  # but this node's workers are aborted, for the group to restart
    assert ranks == [0, 1] and "recorded by another node" in reason
    (job, key, local), = cluster.calls
    assert key == "10" and local["verdict"]["summary"].startswith("no lagging rank")
    sim.run(3)  # progress after the restart: nothing to resolve here
    wd.check_once()
    assert actions.records == []


def test_the_owner_names_a_culprit_on_another_node(tmp_path):
    sim, actions = Sim(ranks=2), Actions(answer={0, 1})
    remote = {"n2": {"node": "n2", "verdict": {"culprits": [4], "summary": "rank 4 never entered all_reduce #31"}}}
    wd = Watchdog(sim.js, actions, node="n1", config=WatchdogConfig(hang=HangConfig(startup_s=30, warmup_steps=3)),
                  clock=sim.clock, wall=sim.clock, sleep=sim.clock.sleep, probe=lambda pid: "stopped",
                  diagnostics_dir=lambda job: tmp_path / job, cluster=FakeCoordinator(others=remote))
    _hang(sim, wd)
    opened = actions.records[0]
    assert opened.kind is IncidentKind.HANG and opened.ranks == (4,)
    assert opened.evidence["cluster"]["culprit_nodes"] == {"4": "n2"}
    assert "culprit rank 4 on n2" in opened.evidence["summary"]
    (_, _, reason), = actions.aborts
    assert "rank 4 on n2" in reason


def test_the_owner_aborts_its_workers_before_it_waits_for_a_node_that_never_answers(tmp_path):
    """A partitioned node never sends its verdict: the owner waited `verdict_wait_s` (3 s) before it aborted its
    own workers, when the other nodes had aborted theirs at once, and the next round waited for the owner's."""
    sim, actions = Sim(ranks=2), Actions(answer={0, 1})
    remote = {"n0": {"node": "n0", "verdict": {"culprits": [], "summary": "every rank is inside the same collective"}}}
    cluster = FakeCoordinator(others=remote, awaited="n2", actions=actions)
    wd = Watchdog(sim.js, actions, node="n1", config=WatchdogConfig(hang=HangConfig(startup_s=30, warmup_steps=3)),
                  clock=sim.clock, wall=sim.clock, sleep=sim.clock.sleep, probe=lambda pid: "stopped",
                  diagnostics_dir=lambda job: tmp_path / job, cluster=cluster)
    _hang(sim, wd)
    (_, ranks, reason), = cluster.aborts_when_waited  # aborted before the wait ended, and once only
    assert ranks == [0, 1] and "other nodes' verdicts awaited" in reason and len(actions.aborts) == 1
    opened, acting = actions.records[:2]
    assert opened.kind is IncidentKind.HANG and set(opened.evidence["cluster"]["verdicts"]) == {"n0", "n1"}
    assert acting.state is IncidentState.ACTING
    # no culprit anywhere: the incident says which node never answered (the soak's hour, session 33: a 5 s
    # partition, shorter than the membership lease, was "no node named a culprit: n0: ...", n1 unnamed)
    assert opened.evidence["cluster"]["silent_nodes"] == ["n2"] and opened.ranks == ()
    assert opened.evidence["summary"].startswith("node n2 did not answer (cut off from the others, or its agent is "
                                                 "down); no node named a culprit")


def test_without_etcd_the_node_records_the_hang_itself(tmp_path):
    sim, actions = Sim(ranks=2), Actions(answer={0, 1})
    wd = Watchdog(sim.js, actions, node="n1", config=WatchdogConfig(hang=HangConfig(startup_s=30, warmup_steps=3)),
                  clock=sim.clock, wall=sim.clock, sleep=sim.clock.sleep, probe=lambda pid: "stopped",
                  diagnostics_dir=lambda job: tmp_path / job, cluster=FakeCoordinator(fail=True))
    _hang(sim, wd)
    assert [i.kind for i in actions.records[:1]] == [IncidentKind.HANG] and len(actions.aborts) == 1


def test_the_quiet_read_period_comes_from_the_environment_and_a_bad_one_says_what_to_do(monkeypatch):
    from trainwarden.agent.node.agent import QUIET_READ_PERIOD_ENV, watchdog_config

    assert watchdog_config().quiet_read_period_s == 6.0
    monkeypatch.setenv(QUIET_READ_PERIOD_ENV, "0")
    assert watchdog_config().quiet_read_period_s == 0.0
    for bad in ("soon", "-1", "120"):
        monkeypatch.setenv(QUIET_READ_PERIOD_ENV, bad)
        with pytest.raises(ValueError, match="TRAINWARDEN_QUIET_READ_PERIOD_S.*between 0"):
            watchdog_config()


class _ReachedAll(Actions):
    """The real agent reaches a SIGSTOPped rank too: its stream stays open, the command waits in its socket."""

    def request_diagnostics(self, job, ranks, directory):
        super().request_diagnostics(job, ranks, directory)
        return list(ranks)


@pytest.mark.parametrize("state, waited", [("stopped", False), ("dead", False), ("no_answer", True)])
def test_the_diagnostics_wait_ends_once_only_stopped_or_dead_ranks_are_silent(tmp_path, state, waited):
    """A stopped or dead rank can never answer: waiting diagnostics_wait_s for it only delayed the incident (by
    3 s in bench_auto_instrument.py's SIGSTOP trials). A silent rank that runs may still answer: it gets the
    whole wait."""
    sim = Sim(ranks=4)
    actions = _ReachedAll(answer={0, 2, 3})
    cfg = WatchdogConfig(hang=HangConfig(startup_s=30, warmup_steps=3))
    wd = Watchdog(sim.js, actions, node="n1", config=cfg, clock=sim.clock, wall=sim.clock, sleep=sim.clock.sleep,
                  probe=lambda pid: state if pid == 101 else "no_answer", diagnostics_dir=lambda job: tmp_path / job)
    wd.check_once()
    sim.run(10)
    wd.check_once()
    sim.clock.now += 6
    before = sim.clock.now
    wd.check_once()
    opened = actions.records[0]
    assert opened.kind is IncidentKind.HANG and opened.ranks == (1,)
    assert opened.evidence["verdict"]["unresponsive"] == {"1": state}
    took = sim.clock.now - before
    if waited:
        assert took >= cfg.diagnostics_wait_s
    else:
        assert took < 0.5, took


def test_activity_is_read_only_once_a_job_stalls_and_a_computing_rank_keeps_it_alive(tmp_path):
    """The watchdog reads the ranks' CPU and I/O only after a second without progress (a healthy job costs it
    nothing), and a rank whose process tree keeps computing then is not hung on the short floor."""
    sim = Sim(ranks=2)
    actions = Actions(answer={0, 1})
    cpu = {100: 10.0, 101: 10.0}
    reads = []

    def cpu_seconds(pid):
        reads.append(pid)
        return cpu[pid]

    cfg = WatchdogConfig(hang=HangConfig(startup_s=30, warmup_steps=3, busy_s=60.0))
    wd = Watchdog(sim.js, actions, node="n1", config=cfg, clock=sim.clock, wall=sim.clock, sleep=sim.clock.sleep,
                  probe=lambda pid: "stopped", diagnostics_dir=lambda job: tmp_path / "j",
                  cpu_seconds=cpu_seconds, io_bytes=lambda pid: 0)
    _steady(sim, wd)
    assert reads == []
    for _ in range(20):  # 10 s: rank 0's DataLoader workers prepare the next epoch, rank 1 waits
        sim.clock.now += 0.5
        cpu[100] += 0.5
        wd.check_once()
    assert reads and actions.records == []
    for _ in range(8):  # then nothing computes: a hang on the 2 s floor
        sim.clock.now += 0.5
        wd.check_once()
    assert {(r.kind, r.id) for r in actions.records} == {(IncidentKind.HANG, actions.records[0].id)}


@pytest.mark.parametrize("pending", [1.0, 0.0])
def test_ranks_still_inside_a_call_with_a_collective_in_flight_wait_and_their_spin_is_not_work(tmp_path, pending):
    """Both ranks spin a core with their training thread still inside one call (a CUDA synchronize). With a
    collective in flight they wait: a hang on the floor. Without one they compute (an evaluation in one
    native call): not hung."""
    sim = Sim(ranks=2)
    actions = Actions(answer={0, 1})
    cpu = {100: 10.0, 101: 10.0}
    cfg = WatchdogConfig(hang=HangConfig(startup_s=30, warmup_steps=3, busy_s=60.0))
    wd = Watchdog(sim.js, actions, node="n1", config=cfg, clock=sim.clock, wall=sim.clock, sleep=sim.clock.sleep,
                  probe=lambda pid: "stopped", diagnostics_dir=lambda job: tmp_path / "j",
                  cpu_seconds=cpu.get, own_cpu_seconds=cpu.get, io_bytes=lambda pid: 0)
    _steady(sim, wd)
    for i in range(40):  # 10 s
        sim.clock.now += 0.25
        for pid in cpu:
            cpu[pid] += 0.25
        if i % 2 == 0:  # the workers report every 0.5 s
            for rank in (0, 1):
                sim.js.record_training_thread("j", rank, still_seconds=0.5 + i * 0.25,
                                              collective_pending_seconds=pending and 0.5 + i * 0.25)
        wd.check_once()
        if actions.records:
            break
    if pending:
        assert {(r.kind, r.id) for r in actions.records} == {(IncidentKind.HANG, actions.records[0].id)}
        assert actions.records[0].evidence["deadline"] == "steady"
        assert set(actions.records[0].evidence["waiting_in_collective"]) == {"0", "1"}
        assert i * 0.25 < 6, "the spin of waiting ranks held the hang"
    else:
        assert actions.records == []


def test_a_node_whose_ranks_wait_while_another_nodes_rank_works_holds_the_hang_back(tmp_path):
    """Rank 0 evaluates alone on another node; this node's ranks wait in a collective (no CPU, no I/O). The other
    node's busy beacon holds the hang back for as long as it is there; once it goes, the usual deadline applies."""
    sim, actions = Sim(ranks=2), Actions(answer={0, 1})
    cluster = FakeCoordinator(busy=["n0"])
    wd = Watchdog(sim.js, actions, node="n1", config=WatchdogConfig(hang=HangConfig(startup_s=30, warmup_steps=3)),
                  clock=sim.clock, wall=sim.clock, sleep=sim.clock.sleep, probe=lambda pid: "stopped",
                  diagnostics_dir=lambda job: tmp_path / job, cluster=cluster, cpu_seconds=lambda pid: 1.0,
                  io_bytes=lambda pid: 0)
    for _ in range(5):
        sim.run(2)
        wd.check_once()
    for _ in range(120):  # 30 s of n0 working
        sim.clock.now += 0.25
        wd.check_once()
    assert actions.records == [] and actions.aborts == [] and cluster.calls == []
    cluster.busy = []  # n0's rank is done, and now it is the one that hangs
    for _ in range(40):
        sim.clock.now += 0.25
        wd.check_once()
    assert [r.kind for r in actions.records[:1]] == [IncidentKind.HANG] and len(actions.aborts) == 1
    assert cluster.said == [False]  # this node's ranks never worked: it never said otherwise


def test_a_node_whose_ranks_work_while_the_job_is_stalled_says_so_and_stops_saying_when_it_progresses(tmp_path):
    sim, actions = Sim(ranks=2), Actions(answer={0, 1})
    cpu = {100: 10.0, 101: 10.0}
    cluster = FakeCoordinator()
    wd = Watchdog(sim.js, actions, node="n0", config=WatchdogConfig(hang=HangConfig(startup_s=30, warmup_steps=3)),
                  clock=sim.clock, wall=sim.clock, sleep=sim.clock.sleep, probe=lambda pid: "stopped",
                  diagnostics_dir=lambda job: tmp_path / job, cluster=cluster, cpu_seconds=cpu.get,
                  io_bytes=lambda pid: 0)
    for _ in range(5):
        sim.run(2)
        wd.check_once()
    for _ in range(40):  # rank 0 evaluates alone for 10 s
        sim.clock.now += 0.25
        cpu[100] += 0.25
        wd.check_once()
    assert cluster.said == [False, True] and actions.records == []
    sim.run(2)
    wd.check_once()
    assert cluster.said == [False, True, False]


def test_when_etcd_cannot_be_asked_about_other_nodes_the_node_judges_alone(tmp_path, caplog):
    sim, actions = Sim(ranks=2), Actions(answer={0, 1})
    wd = Watchdog(sim.js, actions, node="n1", config=WatchdogConfig(hang=HangConfig(startup_s=30, warmup_steps=3)),
                  clock=sim.clock, wall=sim.clock, sleep=sim.clock.sleep, probe=lambda pid: "stopped",
                  diagnostics_dir=lambda job: tmp_path / job, cluster=FakeCoordinator(fail=True, busy=["n0"]))
    _hang(sim, wd)
    assert [i.kind for i in actions.records[:1]] == [IncidentKind.HANG] and len(actions.aborts) == 1
    assert sum("cannot share the ranks' activity" in r.getMessage() for r in caplog.records) == 1


def test_an_unreachable_etcd_is_asked_about_a_jobs_activity_once_per_retry_period_not_every_check(tmp_path):
    """Every call to an unreachable etcd costs the client's timeout, and the watchdog checks every job four times
    a second: after a failure the node judges alone for CLUSTER_RETRY_S, then asks again."""
    from trainwarden.agent.watchdog.cluster_hang import CLUSTER_RETRY_S

    class Counting(FakeCoordinator):
        asked = 0

        def set_busy(self, job, busy):
            Counting.asked += 1
            super().set_busy(job, busy)

    sim, actions = Sim(ranks=2), Actions(answer={0, 1})
    cluster = Counting(fail=True)
    wd = Watchdog(sim.js, actions, node="n1", config=WatchdogConfig(hang=HangConfig(startup_s=30, warmup_steps=3)),
                  clock=sim.clock, wall=sim.clock, sleep=sim.clock.sleep, probe=lambda pid: "stopped",
                  diagnostics_dir=lambda job: tmp_path / job, cluster=cluster)
    for _ in range(4 * int(CLUSTER_RETRY_S) * 2):  # two retry periods of checks, the job training
        sim.run(1)
        wd.check_once()
    assert Counting.asked <= 3, Counting.asked
    cluster.fail = False  # etcd is back: asked at every check again
    sim.clock.now += CLUSTER_RETRY_S
    before = Counting.asked
    for _ in range(4):
        sim.run(1)
        wd.check_once()
    assert Counting.asked == before + 4


def test_no_straggler_incident_while_the_job_is_in_a_communication_regression(tmp_path):
    """The soak's hour (seed 46, #43): a link degraded just after a rejoin; n0's rank 0 was named a straggler 0.5 s
    after the comm_regression that explained the slowdown (its peers' work looked flat against a level learned from
    degraded slices). A start while the job's links are suspect is suppressed, its end with it; after, as before."""
    from trainwarden.agent.watchdog.comm_regression import RankTotals
    from trainwarden.agent.watchdog.straggler import RankScore, StragglerEvent

    sim = Sim(ranks=4)
    actions = Actions()
    wd = _watchdog(sim, actions, tmp_path)
    detector, totals, t = wd._comm.detector, {r: [0, 0.0, 0.0] for r in range(4)}, 0.0
    for seconds, wait in ((90, 0.02), (30, 0.4)):  # healthy, then every rank waits 20x longer in collectives
        for _ in range(seconds):
            t += 1.0
            for c in totals.values():
                steps = max(1, round(1.0 / (0.08 + wait)))
                c[0], c[1], c[2] = c[0] + steps, c[1] + steps * (0.08 + wait), c[2] + steps * wait
            detector.update("j", t, {r: RankTotals(steps=c[0], step_seconds=c[1], wait_seconds=c[2], pid=100 + r)
                                     for r, c in totals.items()})
    assert detector.regressed("j") and detector.links_suspect("j")
    score = RankScore(rank=0, score=1.53, compute_share=0.95, peer_compute_share=0.62, window_seconds=33.6, slices=14,
                      flagged=True)
    snap = sim.js.snapshot("j")[0]

    def event(started):
        return StragglerEvent(job="j", rank=0, started=started, score=score, evaluations=7, seconds=16.8,
                          policy=StragglerPolicy.ALERT)

    wd._straggler_incidents.on_event(snap, event(True))
    wd._straggler_incidents.on_event(snap, event(False))
    assert actions.records == [] and wd.suppressed == {"j": 1}
    assert not detector.links_suspect("other")
    for _ in range(40):  # the link is back
        t += 1.0
        for c in totals.values():
            c[0], c[1], c[2] = c[0] + 10, c[1] + 1.0, c[2] + 0.2
        detector.update("j", t, {r: RankTotals(steps=c[0], step_seconds=c[1], wait_seconds=c[2], pid=100 + r)
                                 for r, c in totals.items()})
    assert not detector.links_suspect("j")
    wd._straggler_incidents.on_event(snap, event(True))
    assert [i.kind for i in actions.records] == [IncidentKind.STRAGGLER_START]


class _LateCoordinator(FakeCoordinator):
    """n2 is awaited and never answers in time; its verdict is under the hang's key from ``late_after`` on."""

    def __init__(self, late, **kw):
        super().__init__(**kw)
        self.late, self.reads = late, []

    def verdicts(self, job, key):
        self.reads.append((job, key))
        return {"n1": {"node": "n1"}, **({"n2": self.late} if len(self.reads) >= 3 else {})}


def test_a_verdict_that_comes_after_the_hang_was_recorded_names_its_culprit_in_the_incident(tmp_path):
    """The soak's hour (session 33): rank 6 on n1 was SIGSTOPped while n1's ranks finished a save, so n1 judged
    the hang 5.6 s after n0; n0, the owner, recorded "node n1 did not answer" with no rank, and n1's verdict ("rank
    6 is stopped") came 7 s later. The owner reads the verdicts again for a while and amends the incident."""
    sim, actions = Sim(ranks=2), Actions(answer={0, 1})
    late = {"node": "n2", "verdict": {"culprits": [6], "summary": "rank 6 is stopped (SIGSTOP)"}}
    cluster = _LateCoordinator(late, awaited="n2", actions=actions)
    wd = Watchdog(sim.js, actions, node="n1", config=WatchdogConfig(hang=HangConfig(startup_s=30, warmup_steps=3)),
                  clock=sim.clock, wall=sim.clock, sleep=sim.clock.sleep, probe=lambda pid: "stopped",
                  diagnostics_dir=lambda job: tmp_path / job, cluster=cluster)
    _hang(sim, wd)
    opened = actions.records[0]
    assert opened.ranks == () and opened.evidence["cluster"]["silent_nodes"] == ["n2"]
    for _ in range(3):  # the checks after: the late verdict arrives at the third read
        sim.clock.now += 0.5
        wd.check_once()
    amended = actions.records[-1]
    assert amended.id == opened.id and amended.ranks == (6,) and amended.state is IncidentState.ACTING
    assert amended.evidence["cluster"]["culprit_nodes"] == {"6": "n2"}
    assert amended.evidence["cluster"]["late_verdicts"] == ["n2"] and amended.evidence["cluster"]["silent_nodes"] == []
    assert amended.evidence["summary"].startswith("culprit rank 6 on n2")
    sim.run(3)  # the job progresses: the resolution keeps the culprit
    wd.check_once()
    resolved = actions.records[-1]
    assert resolved.id == opened.id and resolved.state is IncidentState.RESOLVED and resolved.ranks == (6,)
    reads = len(cluster.reads)
    for _ in range(5):  # every node answered: no more reads
        sim.run(1)
        wd.check_once()
    assert len(cluster.reads) == reads

import pytest

from trainwarden.agent.common.job_lifecycle import IllegalTransition, JobPhase, JobRecord
from trainwarden.agent.launch.progress import JobProgress

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_steps_rounds_and_time_lost_from_telemetry_and_launcher_events():
    clock = Clock()
    p = JobProgress(wall=clock)
    p.round_started(clock.now)
    firsts = []
    for step in range(1, 26):
        clock.now += 0.3
        for pid in (11, 12):  # every rank reports every step: counted once per worker
            firsts.append(p.step(step, clock.now, 0.3, worker=pid))
    assert firsts.count(True) == 1 and firsts[0] is True
    last_good = clock.now
    clock.now += 2
    failure = p.round_failed(clock.now)
    p.step(25, last_good, 0.3, worker=12)  # a late report of a step already counted changes nothing
    p.restarting(after_failure=True)
    clock.now += 10  # rendezvous + restore
    p.round_started(clock.now)
    assert not p.in_round
    for step in range(21, 27):  # resumed from the checkpoint at step 20
        clock.now += 0.3
        p.step(step, clock.now, 0.3, worker=21)
    assert p.in_round and p.restarts == 1
    assert failure.last_step == 25 and failure.resumed_from == 21
    assert failure.lost_seconds == pytest.approx(clock.now - last_good)  # recovered when step 26 completed
    assert p.max_step == 26 and p.source == "telemetry" and p.last_loss is None
    assert p.median_step_seconds() == pytest.approx(0.3)


def test_log_lines_are_only_a_fallback():
    clock = Clock()
    p = JobProgress(wall=clock)
    p.round_started()
    assert p.feed_line("step 1 loss 5.0 time 0.300s\n") == (1, True)
    assert p.feed_line("rank 0 says hello\n") is None
    assert p.max_step == 1 and p.source == "log" and p.last_loss == "5.0"
    p.step(1, clock.now, 0.2, worker=7)  # telemetry turns up: it replaces what the log said
    p.feed_line("step 9 loss 4.0 time 0.300s\n")
    assert p.source == "telemetry" and p.max_step == 1


def test_membership_restarts_are_not_failures_and_an_unrecovered_failure_costs_nothing_yet():
    p = JobProgress(wall=Clock())
    p.restarting(after_failure=False)
    assert p.restarts == 0
    p.round_failed()
    p.restarting(after_failure=True)
    assert p.restarts == 1 and p.failures[0].lost_seconds is None and p.lost_seconds == 0


def test_job_lifecycle_transitions():
    rec = JobRecord(job="j")
    rec.transition(JobPhase.STARTING)
    rec.transition(JobPhase.RUNNING)
    rec.transition(JobPhase.RESTARTING)
    rec.transition(JobPhase.RUNNING)
    rec.transition(JobPhase.RESTARTING, "nodes joined", failure=False)
    rec.transition(JobPhase.RUNNING)
    rec.transition(JobPhase.SUCCEEDED)
    assert rec.restarts == 1 and rec.to_json()["phase"] == "succeeded"
    with pytest.raises(IllegalTransition):
        rec.transition(JobPhase.RUNNING)


def test_pending_cannot_jump_to_running():
    with pytest.raises(IllegalTransition):
        JobRecord(job="j").transition(JobPhase.RUNNING)


def test_supervisor_gone_tells_a_leftover_from_a_live_run():
    import os

    import psutil

    from trainwarden.agent.common.job_lifecycle import supervisor_gone

    me = {"host": "h", "pid": os.getpid(), "started": psutil.Process().create_time()}
    assert not supervisor_gone(me, host="h")                      # alive: really running
    assert not supervisor_gone(me, host="other")                  # another host: cannot tell, assume alive
    assert supervisor_gone({**me, "started": 1.0}, host="h")       # the pid was reused by another process
    assert supervisor_gone({**me, "pid": 2**22 + 7}, host="h")     # no such process
    assert not supervisor_gone({}, host="h")                       # no owner recorded


def test_a_supervisor_killed_but_not_yet_reaped_is_gone():
    """A SIGKILLed `trainwarden run` whose parent died with it stays a zombie until PID 1 reaps it: 1.4 s on this
    VM's init, longer under load, for ever under an init that does not reap (a container's). Session 36's soak
    (daemon-run, both nodes power-killed): the daemon started n1's launcher again 3 s later, which found its own
    node's record still owned by that zombie, took it for a live run and exited 2; the node never came back."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from trainwarden.agent.common.job_lifecycle import supervisor_gone

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        owner = {"host": "h", "pid": child.pid, "started": psutil.Process(child.pid).create_time()}
        assert not supervisor_gone(owner, host="h")
        child.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)  # not reaped: no wait() until the end
        assert psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE
        assert supervisor_gone(owner, host="h")
    finally:
        child.kill()
        child.wait()


def test_steps_of_the_failed_round_reported_after_the_failure_still_count_before_it():
    """The launcher's report can reach the supervisor before a surviving rank's last batch of step telemetry:
    the failure is "after step 49" once that batch arrives, not after the last step seen in time."""
    clock = Clock()
    p = JobProgress(wall=clock)
    p.round_started(clock.now)
    for step in range(1, 24):
        clock.now += 0.01
        p.step(step, clock.now, 0.01, worker=11)
    late = [(step, clock.now + 0.01 * (step - 23)) for step in range(24, 50)]
    clock.now += 0.5
    failure = p.round_failed(clock.now)
    assert failure.last_step == 23
    for step, ended in late:
        p.step(step, ended, 0.01, worker=11)
    assert failure.last_step == 49 and failure.last_step_at == late[-1][1]
    p.restarting(after_failure=True)
    clock.now += 5
    p.round_started(clock.now)
    p.step(41, clock.now + 0.01, 0.01, worker=21)  # the next round, from the checkpoint at 40
    assert failure.last_step == 49 and failure.resumed_from == 41


def test_failures_in_a_row_before_any_recovery_are_each_charged_until_the_next_not_all_from_the_first():
    """Issue 45, the warm-restart stress: 200 rounds in a row failed at step 3 before the job ever passed it; every
    failure was charged from the first time step 3 ended to the end of the run (425.1 s each, 85,020 s "lost" in a
    437 s run). Each failure now runs until the next one takes over; together they are the time from the last good
    step to the recovery."""
    clock = Clock()
    p = JobProgress(wall=clock)
    p.round_started(clock.now)
    worker = 0
    for step in (1, 2, 3):
        clock.now += 0.5
        p.step(step, clock.now, 0.5, worker=worker)
    last_good = clock.now
    failures = []
    for _ in range(5):  # each round restores step 0 and fails at its step 3, before passing the job's step 3
        clock.now += 0.2
        failures.append(p.round_failed(clock.now))
        clock.now += 1.0
        p.round_started(clock.now)
        worker += 1
        for step in (1, 2):
            clock.now += 0.5
            p.step(step, clock.now, 0.5, worker=worker)
    for step in (3, 4):  # the last round passes step 3
        clock.now += 0.5
        p.step(step, clock.now, 0.5, worker=worker)
    lost = [f.lost_seconds for f in failures]
    assert all(x is not None and x <= 3.0 + 1e-6 for x in lost), lost  # each about one round long
    assert p.lost_seconds == pytest.approx(clock.now - last_good)  # recovered when step 4 ended


def test_what_a_run_keeps_to_count_each_workers_step_once_does_not_grow_with_the_steps():
    """A run of 2,400 steps on four ranks kept every (worker, step) it had seen: 9,600 entries, 1.3 MB of the
    launcher's memory, growing all run long (issue 45's soak). A worker's steps arrive in order, so its highest
    counted step is enough: a step repeated after a rollback is still counted once."""
    clock = Clock()
    p = JobProgress(wall=clock)
    p.round_started(clock.now)
    for step in range(1, 2401):
        clock.now += 0.3
        for pid in (11, 12, 13, 14):
            p.step(step, clock.now, 0.3, worker=pid)
    durations = len(p._durations)
    for step in range(2391, 2401):  # a NaN rollback: the same workers run steps 2391..2400 again
        clock.now += 0.3
        for pid in (11, 12, 13, 14):
            assert p.step(step, clock.now, 0.3, worker=pid) is False
    assert len(p._durations) == durations  # nothing counted twice
    assert len(p._counted) == 4 and p.max_step == 2400
    p.round_started(clock.now)  # a new worker's first step still counts
    assert p.step(2391, clock.now + 1, 0.3, worker=21) is True

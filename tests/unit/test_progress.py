import pytest

from trainwarden.agent.common.job_lifecycle import IllegalTransition, JobPhase, JobRecord
from trainwarden.agent.launch.progress import ProgressTracker

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_tracks_steps_restart_and_time_lost():
    clock = Clock()
    t = ProgressTracker(clock=clock)
    for step in range(1, 26):
        clock.now += 0.3
        t.feed(f"step {step} loss {5 - step * 0.1:.6f} time 0.300s\n")
    last_good = clock.now
    clock.now += 2
    t.feed("[default] Worker group FAILED. 2/2 attempts left; will restart worker group\n")
    clock.now += 10  # rendezvous + restore
    for step in range(21, 27):  # resumed from the checkpoint at step 20
        clock.now += 0.3
        t.feed(f"step {step} loss 3.0 time 0.300s\n")
    assert t.restarts == 1
    failure = t.failures[0]
    assert failure.last_step == 25 and failure.resumed_from == 21
    # recovered when step 26 (past 25) completed
    assert failure.lost_seconds == pytest.approx(clock.now - last_good)
    assert t.max_step == 26 and t.last_loss == "3.0"
    assert t.median_step_seconds() == pytest.approx(0.3)


def test_unrecovered_failure_costs_nothing_yet():
    t = ProgressTracker(clock=Clock())
    t.feed("will restart worker group")
    assert t.restarts == 1 and t.failures[0].lost_seconds is None and t.lost_seconds == 0


def test_job_lifecycle_transitions():
    rec = JobRecord(job="j")
    rec.transition(JobPhase.STARTING)
    rec.transition(JobPhase.RUNNING)
    rec.transition(JobPhase.RESTARTING)
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

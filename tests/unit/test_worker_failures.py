import pytest

from trainwarden.agent.incidents import IncidentKind, IncidentState
from trainwarden.agent.incidents.worker_failures import WorkerFailureRecorder

pytestmark = pytest.mark.timeout(10)

FAILED = "E1122 14:37:14.328000 27981 api.py:1002] failed (exitcode: {code}) local_rank: {lr} (pid: 27998) of binary: x"
RESTART = "I1122 api.py:942] [default] Worker group FAILED. 1/2 attempts left; will restart worker group"


def recorder():
    versions = []
    rec = WorkerFailureRecorder("j", lambda inc: versions.append(inc) or inc, node="n", wall=lambda: 1000.0)
    return rec, versions


def feed(rec, line):
    rec.feed(line, restarting="will restart worker group" in line, step=None)


def test_crash_incident_from_a_killed_worker_resolves_when_steps_resume():
    rec, versions = recorder()
    feed(rec, FAILED.format(code=-9, lr=5))
    feed(rec, RESTART)
    rec.feed("step 21 loss 1.0 time 0.3s", restarting=False, step=21)
    assert [v.state for v in versions] == [IncidentState.OPEN, IncidentState.ACTING, IncidentState.RESOLVED]
    final = versions[-1]
    assert final.kind == IncidentKind.CRASH and final.ranks == (5,)
    assert final.evidence["failed_workers"][0]["cause"] == "SIGKILL"
    assert final.outcome == "running again at step 21"


def test_watchdog_abort_is_a_restart_not_a_crash():
    rec, versions = recorder()
    for lr in range(2):
        feed(rec, FAILED.format(code=75, lr=lr))
    feed(rec, RESTART)
    assert versions[-1].kind == IncidentKind.RESTART and versions[-1].ranks == (0, 1)


def test_budget_spent_is_a_failed_crash():
    rec, versions = recorder()
    feed(rec, FAILED.format(code=1, lr=0))
    rec.job_failed("torchrun exited with 1")
    assert versions[-1].state == IncidentState.FAILED and versions[-1].kind == IncidentKind.CRASH


def test_a_second_restart_before_any_step_fails_the_first_incident():
    rec, versions = recorder()
    feed(rec, FAILED.format(code=-9, lr=1))
    feed(rec, RESTART)
    feed(rec, FAILED.format(code=1, lr=1))
    feed(rec, RESTART)
    rec.feed("step 5 loss 1.0 time 0.3s", restarting=False, step=5)
    final = {}
    for v in versions:
        final[v.id] = v.state
    assert sorted(s.value for s in final.values()) == ["failed", "resolved"]


def test_a_crash_names_the_rank_that_was_killed_not_the_peer_torchrun_noticed_first():
    from trainwarden.agent.telemetry.job_telemetry import JobTelemetry, WorkerInfo

    now = [1000.0]
    js = JobTelemetry(wall=lambda: now[0])
    for r in range(3):
        js.connect(WorkerInfo(job="j", rank=r, world_size=3, pid=100 + r))
    versions = []
    rec = WorkerFailureRecorder("j", lambda inc: versions.append(inc) or inc, node="n", wall=lambda: now[0],
                          ended_streams=lambda since: js.ended_streams("j", since))
    now[0] = 1001.0
    js.disconnect("j", 2, 102)                       # SIGKILLed: its stream just breaks
    now[0] = 1001.4
    js.goodbye("j", 0, 100, "peer gone: Connection reset by peer")
    js.disconnect("j", 0, 100)                       # its next collective failed; it said why
    feed(rec, FAILED.format(code=1, lr=0))           # torchrun noticed rank 0 first
    feed(rec, RESTART)
    crash = versions[-1]
    assert crash.kind == IncidentKind.CRASH and crash.ranks == (2,)
    assert [e["rank"] for e in crash.evidence["telemetry_streams_ended"]] == [2, 0]
    assert crash.evidence["telemetry_streams_ended"][1]["how"] == "goodbye: peer gone: Connection reset by peer"
    assert crash.evidence["failed_workers"][0]["local_rank"] == 0   # torchrun's report is kept
    assert crash.evidence["summary"] == ("rank 2 failed first: its stream ended without a goodbye (killed by a "
                                         "signal or died hard), 1 other rank(s) followed; torchrun reported "
                                         "local rank 0 (exit code 1)")
    # the next round only looks at streams that ended after this incident
    assert rec._since == 1001.4


def test_when_the_first_to_leave_left_for_a_lost_peer_torchruns_report_stands():
    from trainwarden.agent.telemetry.job_telemetry import JobTelemetry, WorkerInfo

    js = JobTelemetry(wall=lambda: 1001.0)
    js.connect(WorkerInfo(job="j", rank=0, world_size=2, pid=100))
    js.goodbye("j", 0, 100, "peer gone: Connection closed by peer")   # the failed rank is on another node
    js.disconnect("j", 0, 100)
    versions = []
    rec = WorkerFailureRecorder("j", lambda inc: versions.append(inc) or inc, node="n", wall=lambda: 1000.0,
                          ended_streams=lambda since: js.ended_streams("j", since))
    feed(rec, FAILED.format(code=1, lr=0))
    feed(rec, RESTART)
    assert versions[-1].ranks == (0,) and versions[-1].evidence["ranks_are"].startswith("local ranks")

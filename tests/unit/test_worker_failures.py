"""Crash and restart incidents from the launcher's structured report of a failed round (no log lines)."""

import pytest

from trainwarden.agent.incidents import IncidentKind, IncidentState
from trainwarden.agent.incidents.worker_failures import WorkerFailureRecorder, describe_exit

pytestmark = pytest.mark.timeout(10)


def failed(rank, code, local=None, message=""):
    return {"global_rank": rank, "local_rank": rank if local is None else local, "pid": 27998 + rank,
            "exitcode": code, "message": message}


def recorder(**kw):
    versions = []
    rec = WorkerFailureRecorder("j", lambda inc: versions.append(inc) or inc, node="n", wall=lambda: 1000.0, **kw)
    return rec, versions


def test_crash_incident_from_a_killed_worker_resolves_when_steps_resume():
    rec, versions = recorder()
    rec.round_failed([failed(5, -9)])
    rec.restarting()
    rec.resumed(21)
    assert [v.state for v in versions] == [IncidentState.OPEN, IncidentState.ACTING, IncidentState.RESOLVED]
    final = versions[-1]
    assert final.kind == IncidentKind.CRASH and final.ranks == (5,)
    assert final.evidence["failed_workers"][0]["cause"] == "SIGKILL"
    assert final.outcome == "running again at step 21"


def test_the_error_file_message_is_evidence():
    rec, versions = recorder()
    rec.round_failed([failed(1, 1, message="ValueError: bad shape")])
    rec.restarting()
    assert versions[-1].evidence["failed_workers"][0]["error"] == "ValueError: bad shape"


def test_watchdog_abort_is_a_restart_not_a_crash():
    rec, versions = recorder()
    rec.round_failed([failed(r, 75) for r in range(2)])
    rec.restarting()
    assert versions[-1].kind == IncidentKind.RESTART and versions[-1].ranks == (0, 1)
    assert describe_exit(75) == "aborted by the agent" and describe_exit(-15) == "SIGTERM"


def test_budget_spent_is_a_failed_crash():
    rec, versions = recorder()
    rec.round_failed([failed(0, 1)])
    rec.job_failed("torchrun exited with 1")
    assert versions[-1].state == IncidentState.FAILED and versions[-1].kind == IncidentKind.CRASH


def test_a_second_restart_before_any_step_fails_the_first_incident():
    rec, versions = recorder()
    rec.round_failed([failed(1, -9)])
    rec.restarting()
    rec.round_failed([failed(1, 1)])
    rec.restarting()
    rec.resumed(5)
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
    rec.round_failed([failed(0, 1)])                 # the launcher noticed rank 0 first
    rec.restarting()
    crash = versions[-1]
    assert crash.kind == IncidentKind.CRASH and crash.ranks == (2,)
    assert [e["rank"] for e in crash.evidence["telemetry_streams_ended"]] == [2, 0]
    assert crash.evidence["telemetry_streams_ended"][1]["how"] == "goodbye: peer gone: Connection reset by peer"
    assert crash.evidence["failed_workers"][0]["global_rank"] == 0   # the launcher's report is kept
    assert crash.evidence["summary"] == ("rank 2 (its stream broke first, without a goodbye): killed, not exited "
                                         "(its peers exit with a code: they cannot make a rank die of a signal); "
                                         "1 collateral (ranks 0)")
    assert crash.evidence["collateral"] == [0]
    # the next round only looks at streams that ended after this incident
    assert rec._since == 1001.4


def test_when_every_rank_here_left_for_a_lost_peer_none_of_them_is_blamed():
    from trainwarden.agent.telemetry.job_telemetry import JobTelemetry, WorkerInfo

    js = JobTelemetry(wall=lambda: 1001.0)
    js.connect(WorkerInfo(job="j", rank=3, world_size=4, pid=28001))
    js.goodbye("j", 3, 28001, "peer gone: Connection closed by peer")   # the failed rank is on another node
    js.disconnect("j", 3, 28001)
    rec, versions = recorder(ended_streams=lambda since: js.ended_streams("j", since))
    rec.round_failed([failed(3, 1, local=0)])
    rec.restarting()
    # every stream here ended for a lost peer: no rank of this node is blamed (it was the launcher's report
    # before multi-node jobs, when this could only be a misattribution)
    assert versions[-1].kind == IncidentKind.RESTART and versions[-1].ranks == ()
    assert versions[-1].evidence["failed_workers"][0]["global_rank"] == 3  # the report is kept as evidence


def test_a_worker_the_agent_killed_after_an_abort_and_peers_torchrun_stopped_are_no_crash():
    rec, versions = recorder(killed_by_agent=lambda pid: pid == 27999)
    rec.round_failed([failed(0, 75), failed(1, -9), failed(2, -15), failed(3, 75)])  # rank 1 was SIGSTOPped
    rec.restarting()
    assert versions[-1].kind == IncidentKind.RESTART
    rec2, versions2 = recorder()
    rec2.round_failed([failed(1, -9), failed(2, -15)])  # a SIGKILL nobody here sent
    rec2.restarting()
    assert versions2[-1].kind == IncidentKind.CRASH and versions2[-1].ranks == (1,)


def test_ranks_that_left_because_a_node_elsewhere_was_lost_are_a_restart_not_a_crash():
    """A multi-node job: n2 loses power; both ranks here exit on a connection reset, saying so. Nothing here
    crashed: no rank of this node is named."""
    from trainwarden.agent.telemetry.job_telemetry import JobTelemetry, WorkerInfo

    js = JobTelemetry(wall=lambda: 1001.0)
    for r in (0, 1):
        js.connect(WorkerInfo(job="j", rank=r, world_size=6, pid=100 + r))
        js.goodbye("j", r, 100 + r, "peer gone: Read error [10.213.0.12]:39045: Connection reset by peer.")
        js.disconnect("j", r, 100 + r)
    rec, versions = recorder(ended_streams=lambda since: js.ended_streams("j", since))
    rec.round_failed([failed(0, 1), failed(1, 1)])
    rec.restarting()
    incident = versions[-1]
    assert incident.kind == IncidentKind.RESTART and incident.ranks == ()
    assert "the failed rank is on another node" in incident.evidence["summary"]


def test_a_sigkilled_rank_among_peers_that_exited_1_is_named_alone_with_the_rest_collateral():
    """8 ranks, rank 5 SIGKILLed at step 12: torchrun reported ranks 1, 3, 5, 6, 7 (the ones it noticed),
    the incident said "crash (ranks 1,3,5,6,7)". A script that sends no telemetry: the signal decides."""
    rec, versions = recorder()
    rec.round_failed([failed(1, 1), failed(3, 1), failed(5, -9), failed(6, 1), failed(7, 1)])
    rec.restarting()
    crash = versions[-1]
    assert crash.kind == IncidentKind.CRASH and crash.ranks == (5,)
    assert crash.evidence["collateral"] == [1, 3, 6, 7]


def test_a_killed_rank_whose_stream_broke_after_its_peers_said_goodbye_is_still_named():
    from trainwarden.agent.telemetry.job_telemetry import JobTelemetry, WorkerInfo

    now = [1000.0]
    js = JobTelemetry(wall=lambda: now[0])
    for r in range(4):
        js.connect(WorkerInfo(job="j", rank=r, world_size=4, pid=27998 + r))
    rec, versions = recorder(ended_streams=lambda since: js.ended_streams("j", since))
    now[0] = 1001.0
    js.goodbye("j", 1, 27999, "peer gone: Connection closed by peer")  # the peer's goodbye arrived first
    js.disconnect("j", 1, 27999)
    now[0] = 1001.2
    js.disconnect("j", 2, 28000)                                        # the killed rank's stream broke later
    rec.round_failed([failed(1, 1), failed(2, -9)])
    rec.restarting()
    assert versions[-1].kind == IncidentKind.CRASH and versions[-1].ranks == (2,)
    assert versions[-1].evidence["collateral"] == [1]


def test_streams_of_an_earlier_round_never_name_a_rank_of_a_later_ones_failure():
    """Seen in the soak (n0, 4 ranks): the watchdog aborted a round (a SIGSTOPped rank; no crash incident), its
    workers' streams broke without a goodbye; 39 s into the next round n1's agent was SIGKILLed, rank 2 here
    exited 1 saying a peer was gone and torchrun stopped the rest. The old round's stream of rank 3 ended first
    and the incident blamed it: "crash, rank 3 (its stream broke first, without a goodbye)"."""
    from trainwarden.agent.telemetry.job_telemetry import JobTelemetry, WorkerInfo

    now = [1612.6]
    js = JobTelemetry(wall=lambda: now[0])
    for r in range(4):
        js.connect(WorkerInfo(job="j", rank=r, world_size=8, pid=19911 + r))
    rec, versions = recorder(ended_streams=lambda since: js.ended_streams("j", since))
    for r in (3, 1, 2, 0):  # the aborted round's workers, killed: no goodbye
        js.disconnect("j", r, 19911 + r)
    rec.round_started(1640.0)  # the next round
    now[0] = 1650.9
    for r in range(4):
        js.connect(WorkerInfo(job="j", rank=r, world_size=8, pid=20398 + r))
        js.goodbye("j", r, 20398 + r, "peer gone: Read error [10.213.0.11]:2796: Connection reset by peer.")
        js.disconnect("j", r, 20398 + r)
    rec.round_failed([failed(0, -15), failed(1, -15), failed(2, 1), failed(3, -15)])
    rec.restarting()
    incident = versions[-1]
    assert incident.kind == IncidentKind.RESTART and incident.ranks == ()
    assert [s["pid"] for s in incident.evidence["telemetry_streams_ended"]] == [20398, 20399, 20400, 20401]

"""The fencing part of ``trainwarden run`` (agent/launch/fencing.py ``Fencing``), with fakes for the membership,
the clock and the job's rounds in etcd: when it cuts a node off, and which checkpoint commits its guard refuses."""

from __future__ import annotations

import grpc
import pytest

from trainwarden.agent.etcd.cluster import round_id
from trainwarden.agent.incidents.record import IncidentKind
from trainwarden.agent.launch.fencing import Fencing
from trainwarden.agent.launch.worker_round import WorkerRound

JOB, NODE = "j", "n1"


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Membership:
    """NodeMembership as fencing reads it: confirmed every ``period`` s while etcd answers, lease ``ttl`` s."""

    def __init__(self, clock: _Clock, *, confirmed: bool = True, ttl: float = 6.0) -> None:
        self._clock, self.ttl, self.period = clock, ttl, ttl / 3
        self.confirmed_at = clock.now if confirmed else None

    def unconfirmed_for(self) -> float:
        return 0.0 if self.confirmed_at is None else self._clock() - self.confirmed_at


class _Ledger:
    """The job's rounds as etcd keeps them (agent/etcd/cluster.py): ids compare as text, newer wins."""

    def __init__(self, current: str | None = None, error: Exception | None = None) -> None:
        self.current, self.error = current, error
        self.published: list[tuple[str | None, dict]] = []

    def advance(self, mine: str) -> str | None:
        if self.error is not None:
            raise self.error
        if self.current is not None and self.current > mine:
            return f"the job's current round is {self.current}: {mine} was left behind"
        self.current = mine
        return None

    def commit(self, mine: str, pointer) -> str | None:
        refusal = self.advance(mine)
        if refusal is None:
            self.published.append((mine, dict(pointer)))
        return refusal

    def publish(self, pointer) -> None:
        if self.error is not None:
            raise self.error
        self.published.append((None, dict(pointer)))


class _Run:
    """What the run gives fencing: its current worker round (replaced as rounds start), its pace, a clock."""

    def __init__(self, *, multi_node: bool = True, ledger: _Ledger | None = None, confirmed: bool = True,
                 stand_in=None) -> None:
        self.clock = _Clock()
        self.round = WorkerRound(generation=2, number=5, pids=(101, 102), ranks=(0, 1))
        self.pace: float | None = 0.5
        self.ledger = ledger if ledger is not None else _Ledger()
        self.membership = _Membership(self.clock, confirmed=confirmed)
        self.fencing = Fencing(job=JOB, node=NODE, multi_node=multi_node, worker_round=lambda: self.round,
                               pace=lambda: self.pace, clock=self.clock, wall_clock=lambda: 1.7e9)
        self.fencing.joined(self.membership, self.ledger, stand_in)

    def commit(self, pid: int = 101, step: int = 40, job: str = JOB) -> str | None:
        return self.fencing.commit_refusal(job, 0, pid, step, f"/ckpt/step-{step:08d}", 1234)


# ---- the commit guard -------------------------------------------------------------------------------------

def test_a_worker_of_the_current_round_with_its_membership_confirmed_publishes_in_that_round():
    run = _Run()
    assert run.commit(pid=102, step=40) is None
    assert run.ledger.published == [(round_id(2, 5), {"step": 40, "path": "/ckpt/step-00000040", "time": 1.7e9,
                                                      "bytes": 1234})]


def test_a_commit_from_a_round_the_job_has_left_is_refused_and_publishes_nothing():
    """Another node started round 6 (the job regrouped without this one): this node's round 5 is stale."""
    run = _Run(ledger=_Ledger(current=round_id(2, 6)))
    refusal = run.commit()
    assert refusal is not None and "left behind" in refusal
    assert run.ledger.published == [] and run.ledger.current == round_id(2, 6)


def test_a_worker_of_this_nodes_previous_round_may_not_commit():
    run = _Run()
    run.round = WorkerRound(generation=2, number=6, pids=(201, 202), ranks=(0, 1))  # the supervisor's new round
    assert run.commit(pid=101) == "rank 0 (pid 101) is not a worker of node n1's current round"
    assert run.commit(pid=201) is None
    assert run.ledger.published[0][0] == round_id(2, 6)


def test_a_node_cut_off_from_etcd_may_not_commit_and_does_not_wait_on_etcd():
    run = _Run()
    run.clock.now += 2 * run.membership.period + 1.0  # two refreshes missed, and a second
    refusal = run.commit()
    assert refusal is not None and "etcd has not confirmed node n1's membership for 5 s" in refusal
    assert run.ledger.published == [] and run.ledger.current is None  # etcd was not asked


def test_a_membership_etcd_never_confirmed_refuses_every_commit():
    run = _Run(confirmed=False)
    refusal = run.commit()
    assert refusal is not None and "membership for ever" in refusal and run.ledger.published == []


def test_before_the_node_entered_the_job_every_commit_is_refused():
    run = _Run()
    fencing = Fencing(job=JOB, node=NODE, multi_node=True, worker_round=lambda: run.round, pace=lambda: None)
    assert "membership for ever" in fencing.commit_refusal(JOB, 0, 101, 40, "/ckpt/x", 1)


def test_a_warm_worker_commits_for_the_client_it_stands_behind():
    run = _Run(stand_in={555: 101}.get)
    assert run.commit(pid=555) is None
    assert run.commit(pid=556) == "rank 0 (pid 556) is not a worker of node n1's current round"


def test_etcd_failing_under_the_commit_refuses_it_in_one_line():
    run = _Run(ledger=_Ledger(error=grpc.RpcError()))
    refusal = run.commit()
    assert refusal is not None and refusal.startswith("etcd could not check the job's round: ")


def test_a_round_with_no_number_publishes_on_membership_alone():
    run = _Run()
    run.round = WorkerRound(generation=2, number=None, pids=(101,), ranks=(0,))
    assert run.commit() is None
    assert run.ledger.published[0][0] is None and run.ledger.current is None


def test_another_jobs_commit_is_not_this_guards_to_refuse():
    assert _Run(confirmed=False).commit(job="other") is None


# ---- cut off, etcd trouble, the round in etcd ----------------------------------------------------------------

def test_a_node_whose_lease_lapsed_and_whose_workers_stopped_stepping_is_cut_off():
    run = _Run()
    run.fencing.worker_stepped()
    run.clock.now += 5.0
    assert not run.fencing.cut_off() and run.fencing.etcd_trouble()  # within the 6 s lease
    run.clock.now += 1.5
    assert run.fencing.cut_off()


def test_workers_that_still_step_keep_the_node_in_during_an_etcd_outage():
    run = _Run()
    for _ in range(30):
        run.clock.now += 0.5
        run.fencing.worker_stepped()
    assert run.membership.unconfirmed_for() == 15.0 and not run.fencing.cut_off()


@pytest.mark.parametrize("confirmed", [True, False])
def test_a_one_node_job_is_never_cut_off(confirmed):
    run = _Run(multi_node=False, confirmed=confirmed)
    run.clock.now += 60
    assert not run.fencing.cut_off() and not run.fencing.etcd_trouble()


def test_the_fenced_incident_says_for_how_long_etcd_was_away_and_why():
    run = _Run()
    run.clock.now += 12.34
    incident = run.fencing.incident("lost etcd 12 s ago")
    assert incident.kind is IncidentKind.FENCED and (incident.job, incident.node) == (JOB, NODE)
    assert incident.evidence == {"unconfirmed_s": 12.3, "why": "lost etcd 12 s ago"}


def test_a_started_round_becomes_the_jobs_current_round_unless_a_newer_one_is_recorded(caplog):
    run = _Run()
    run.fencing.advance_round(run.round)
    assert run.ledger.current == round_id(2, 5)
    run.fencing.advance_round(WorkerRound(generation=2, number=4))
    assert run.ledger.current == round_id(2, 5) and "left behind" in caplog.text
    broken = _Run(ledger=_Ledger(error=grpc.RpcError()))
    broken.fencing.advance_round(broken.round)  # logged, never raised: a commit advances it too
    assert "cannot record round 5 of job j in etcd" in caplog.text


def test_the_worker_round_the_launcher_announces():
    started = WorkerRound.started(3, {"round": 7, "workers": [{"pid": 12, "global_rank": 3},
                                                               {"pid": 11, "global_rank": 2}, {"global_rank": 4}]})
    assert (started.id, started.pids, started.ranks) == (round_id(3, 7), (12, 11), (2, 3, 4))
    started.stepped(10, 5.0)
    started.stepped(9, 6.0)  # a slower rank's older step
    assert (started.step, started.step_end) == (10, 5.0)

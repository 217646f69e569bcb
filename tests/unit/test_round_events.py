"""What the launcher's events change in ``trainwarden run`` (agent/launch/round_events.py ``RoundEvents``), with fakes
for the records the run keeps (run record, membership, worker failures) and its phase: a new worker round, a failed
round the workers' own verdict stops, a restart, and the grow step on its own thread."""

from __future__ import annotations

import io
import threading

from trainwarden.agent.common.job_lifecycle import JobPhase
from trainwarden.agent.launch.accounting import Accounting
from trainwarden.agent.launch.progress import JobProgress
from trainwarden.agent.launch.round_events import RoundEvents
from trainwarden.agent.launch.spare_swaps import SpareSwaps
from trainwarden.agent.launch.stop_verdict import StopVerdict
from trainwarden.agent.shared.contract import EXIT_NUMERIC_STOP

STARTED = {"event": "started", "t": 100.0, "round": 4,
           "workers": [{"pid": 11, "global_rank": 3}, {"pid": 12, "global_rank": 2}]}


class _Record:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


class _Run:
    def __init__(self, tmp_path, *, multi_node: bool = True) -> None:
        self.out, self.phases, self.advanced, self.grown = io.StringIO(), [], [], threading.Event()
        self.run_record, self.membership, self.failures = _Record(), _Record(), _Record()
        self.verdict = StopVerdict(job="j", numeric_policy="stop", log_path=tmp_path / "run.log", out=self.out)
        self.events = RoundEvents(
            job="j", node="n1", spare_nodes=0, multi_node=multi_node, out=self.out, progress=JobProgress(),
            accounting=Accounting(job="j", node="n1", state_dir=tmp_path, out=self.out, detect_peak=lambda: None),
            verdict=self.verdict, spare_swaps=SpareSwaps("j", node="n1"), generation=lambda: 2,
            advance_round=self.advanced.append, before_growing=lambda round_: self.grown.set(),
            transition=lambda *args, **kwargs: self.phases.append((args, kwargs)))
        self.events.attach(run_record=self.run_record, failures=self.failures, membership=self.membership,
                           spares=None, killed=None)


def test_a_started_round_is_the_current_one_everywhere_it_is_read(tmp_path):
    run = _Run(tmp_path)
    run.events.on_event(STARTED)
    current = run.events.current
    assert (current.generation, current.number, current.pids, current.ranks) == (2, 4, (11, 12), (2, 3))
    assert ("set_workers", ([11, 12],), {}) in run.run_record.calls
    assert ("update", (), {"ranks": [2, 3], "round": 4, "spare": False}) in run.membership.calls
    assert ("round_started", (100.0,), {}) in run.failures.calls


def test_a_round_the_workers_stop_on_non_finite_values_is_not_recorded_as_a_failure(tmp_path):
    run = _Run(tmp_path)
    run.events.on_event(STARTED)
    run.events.on_event({"event": "failed", "t": 101.0, "failures": [
        {"global_rank": 2, "exitcode": EXIT_NUMERIC_STOP, "message": "loss is nan", "pid": 12}]})
    assert run.verdict.numeric_stop == "loss is nan"
    assert not [c for c in run.failures.calls if c[0] == "round_failed"]
    run.events.on_event({"event": "failed", "t": 102.0, "failures": [
        {"global_rank": 2, "exitcode": 1, "message": "boom", "pid": 12}]})
    assert ("round_failed", ([{"global_rank": 2, "exitcode": 1, "message": "boom", "pid": 12}],), {}) \
        in run.failures.calls
    assert "the worker round failed" in run.out.getvalue()


def test_a_restart_after_a_failure_counts_one_and_a_regroup_does_not(tmp_path):
    run = _Run(tmp_path)
    run.events.on_event({"event": "restarting", "t": 103.0, "reason": "failed", "restarts_left": 2})
    run.events.on_event({"event": "restarting", "t": 104.0, "reason": "regroup", "restarts_left": 2})
    assert run.phases == [((JobPhase.RESTARTING, "worker group failed"), {"failure": True}),
                          ((JobPhase.RESTARTING, "a node left the job"), {"failure": False})]


def test_nodes_waiting_to_join_start_the_grow_step_on_its_own_thread(tmp_path):
    run = _Run(tmp_path)
    run.events.on_event({"event": "membership_pending", "t": 105.0, "round": 4})
    assert run.grown.wait(10)

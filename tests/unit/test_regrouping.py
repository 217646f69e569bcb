"""The leave and grow protocols of ``trainwarden run`` (agent/launch/regroup.py ``Regrouping``), with fakes for the
job's leave records in etcd, the local workers' checkpoint requests and torchrun's reply pipe: which step is agreed,
who steps out, and what torchrun is told."""

from __future__ import annotations

import io
import threading

from trainwarden.agent.launch.regroup import GROW_MARGIN_STEPS, Regrouping
from trainwarden.agent.launch.worker_round import WorkerRound

JOB, NODE = "j", "n1"
AHEAD = 10 + GROW_MARGIN_STEPS + 1  # step 10 reported, no pace yet (1 s a step): int(3 s / 1 s) + 1 = 4 steps on


class _Ledger:
    """The job's leave and grow records as etcd keeps them (agent/etcd/cluster.py): the first request stands."""

    def __init__(self, *, requests: dict | None = None, excluded: bool = False, committed: int = 0,
                 agreed: tuple[int, str] | None = None, error: Exception | None = None) -> None:
        self.requests, self._excluded, self.committed = dict(requests or {}), excluded, committed
        self.agreed, self.error = agreed, error
        self.asked: list[tuple] = []
        self.stopped = False

    def refresh(self) -> None:
        if self.error is not None:
            raise self.error

    def excluded(self) -> bool:
        return self._excluded

    def request(self, round_key: str) -> dict | None:
        return self.requests.get(round_key)

    def ask(self, round_key: str, step: int, *, cause: str, ranks: list[int], reason: str) -> dict:
        self.asked.append((round_key, step, cause, ranks, reason))
        return self.requests.setdefault(round_key, {"node": NODE, "step": step, "cause": cause})

    def agree(self, round_key: str, proposal: int) -> tuple[int, str]:
        if self.error is not None:
            raise self.error
        return self.agreed or (proposal, NODE)

    def checkpoint(self) -> dict:
        return {"step": self.committed} if self.committed else {}

    def stop(self) -> None:
        self.stopped = True


class _Run:
    """What the run gives regrouping: its worker round, its node agent's checkpoint requests, torchrun's pipe."""

    def __init__(self, ledger: _Ledger, *, multi_node: bool = True, agent: bool = True) -> None:
        self.round = WorkerRound(generation=1, number=3, pids=(), ranks=(2, 3))
        self.round.stepped(10, 0.0)
        self.ledger, self.out = ledger, io.StringIO()
        self.checkpoints: list[int] = []
        self.replies: list[bytes] = []
        self.regroup = Regrouping(job=JOB, node=NODE, multi_node=multi_node, out=self.out,
                                  worker_round=lambda: self.round, pace=lambda n: None,
                                  spawn=lambda target, *args: target(*args))
        self.regroup.joined(ledger, checkpoint=self._checkpoint if agent else None, reply=self.replies.append,
                            launcher_running=lambda: True)

    def _checkpoint(self, step: int) -> list[int]:
        self.checkpoints.append(step)
        return [2, 3]


def test_a_drained_node_asks_to_leave_after_a_step_ahead_and_leaves_once_its_checkpoint_is_committed():
    run = _Run(_Ledger(committed=AHEAD))
    run.regroup.on_leave_signal(10, None)
    run.regroup.poll()
    assert run.ledger.asked == [("3", AHEAD, "drain", [2, 3], "")]
    assert run.checkpoints == [AHEAD]
    assert run.regroup.left and run.regroup.left_step == AHEAD
    assert run.regroup.left_words() == f"after the checkpoint of step {AHEAD}"
    assert run.replies == []  # the leaver's torchrun is stopped by the run, not told to regroup


def test_another_nodes_leave_has_this_node_save_at_its_step_and_regroup_without_it():
    run = _Run(_Ledger(requests={"3": {"node": "n2", "step": 20}}))
    run.regroup.checkpoint_reported("committed", 20)  # this node's committing rank reported it
    run.regroup.poll()
    assert run.ledger.asked == [] and run.checkpoints == [20]
    assert not run.regroup.left
    assert run.replies == [b"restart 3\n"]
    assert "node n2 has left; the job regroups without it from step 20" in run.out.getvalue()


def test_the_first_request_of_a_round_stands_and_this_node_stays():
    """n2 asked first in round 3: this node's drain waits for the next round; it saves at n2's step and regroups."""
    run = _Run(_Ledger(requests={"3": {"node": "n2", "step": 20}}, committed=20))
    run.regroup.on_leave_signal(10, None)
    run.regroup.poll()
    assert run.ledger.asked == [("3", AHEAD, "drain", [2, 3], "")]
    assert run.checkpoints == [20] and not run.regroup.left and run.replies == [b"restart 3\n"]


def test_a_leave_request_is_acted_on_once_per_round():
    run = _Run(_Ledger(requests={"3": {"node": "n2", "step": 20}}, committed=20))
    run.regroup.poll()
    run.regroup.poll()
    assert run.checkpoints == [20] and run.replies == [b"restart 3\n"]


def test_an_excluded_node_leaves_saying_why():
    run = _Run(_Ledger(excluded=True, committed=AHEAD))
    run.regroup.poll()
    assert run.ledger.asked == [("3", AHEAD, "excluded", [2, 3], "straggler policy exclude")]
    assert run.regroup.leave_asked and run.regroup.left


def test_a_policy_exclusion_names_its_cause_and_reason_in_the_request():
    run = _Run(_Ledger(committed=AHEAD))
    run.regroup.ask_to_leave("excluded", "link check: n1 is slow")
    run.regroup.poll()
    assert run.ledger.asked == [("3", AHEAD, "excluded", [2, 3], "link check: n1 is slow")]


def test_a_leave_whose_checkpoint_failed_leaves_without_a_new_checkpoint():
    run = _Run(_Ledger())
    run.regroup.checkpoint_reported("failed", AHEAD)
    run.regroup.on_leave_signal(10, None)
    run.regroup.poll()
    assert run.regroup.left and run.regroup.left_step is None
    assert run.regroup.left_words() == "without a new checkpoint (it was not committed in time)"


def test_a_one_node_job_leaves_alone_without_asking_etcd():
    run = _Run(_Ledger(committed=AHEAD), multi_node=False)
    run.regroup.on_leave_signal(10, None)
    run.regroup.poll()
    assert run.ledger.asked == [] and run.checkpoints == [AHEAD]
    assert run.regroup.left and run.regroup.left_step == AHEAD


def test_nothing_is_asked_while_etcd_does_not_answer_and_nothing_without_the_agent():
    run = _Run(_Ledger(error=TimeoutError("etcd")))
    run.regroup.on_leave_signal(10, None)
    run.regroup.poll()
    assert run.ledger.asked == [] and not run.regroup.left
    no_agent = _Run(_Ledger(requests={"3": {"node": "n2", "step": 20}}), agent=False)
    no_agent.regroup.poll()
    assert no_agent.checkpoints == [] and no_agent.replies == []


def test_growing_saves_at_the_step_the_nodes_agree_on_then_answers_go():
    run = _Run(_Ledger(agreed=(12, "n2"), committed=12))
    run.regroup.before_growing(3)
    assert run.checkpoints == [12] and run.replies == [b"go\n"]
    assert "every worker checkpoints after step 12 (proposed by n2)" in run.out.getvalue()


def test_growing_answers_go_whatever_goes_wrong():
    run = _Run(_Ledger(error=TimeoutError("etcd")))
    run.regroup.before_growing(3)
    assert run.checkpoints == [] and run.replies == [b"go\n"]
    assert "no checkpoint before the job grows" in run.out.getvalue()


def test_growing_in_a_round_a_node_leaves_resumes_from_the_leaves_checkpoint():
    run = _Run(_Ledger(requests={"3": {"node": "n2", "step": 20}}, committed=20))
    run.regroup.poll()
    run.replies.clear()
    run.regroup.before_growing(3)
    assert run.checkpoints == [20] and run.replies == [b"go\n"]  # no second checkpoint


def test_the_watcher_stops_its_watches_when_done():
    run = _Run(_Ledger())
    done = threading.Event()
    done.set()
    run.regroup.watch(done)
    assert run.ledger.stopped

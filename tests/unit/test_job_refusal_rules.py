"""A job the daemon cannot run is refused once per generation and spec revision (agent/node/job_refusal.py):
the decision, the incident and the record that survives a daemon restart, with a fake ``JobControl``."""

from __future__ import annotations

import pytest

from trainwarden.agent.common.job_spec import parse_job_spec
from trainwarden.agent.etcd.jobs import JobView
from trainwarden.agent.node.job_refusal import JobRefusals, node_problems

pytestmark = pytest.mark.timeout(30)


class FakeControl:
    def __init__(self, wins: bool = True) -> None:
        self.wins, self.calls = wins, []

    def refuse(self, name: str, generation: int, reason: str) -> bool:
        self.calls.append((name, generation, reason))
        return self.wins


def _view(generation=1, revision=7, phase="pending", nodes=None) -> JobView:
    return JobView("j", spec={"managed": True}, state={"phase": phase, "generation": generation},
                   nodes=nodes or {}, spec_revision=revision)


def test_a_pending_job_is_refused_once_and_the_decision_outlives_the_daemon(tmp_path):
    control, incidents = FakeControl(), []
    refusals = JobRefusals(control, node="n0", path=tmp_path / "refused.json", record=incidents.append)
    for _ in range(5):  # five rounds of the daemon
        if not refusals.refused(_view()):
            refusals.refuse(_view(), "script 'x.py' does not exist")
    assert len(control.calls) == 1 and control.calls[0][2] == "refused by node n0: script 'x.py' does not exist"
    [incident] = incidents
    assert (incident.kind.value, incident.node, incident.evidence["generation"]) == ("job_refused", "n0", 1)
    assert "phase refused" in incident.action

    again = JobRefusals(control, node="n0", path=tmp_path / "refused.json", record=incidents.append)
    again.refuse(_view(), "script 'x.py' does not exist")
    assert again.refused(_view()) and len(incidents) == 1  # a restarted daemon does not record it again
    for changed in (_view(generation=2), _view(revision=8)):  # a resume, or the spec submitted again
        assert not again.refused(changed)
    again.refuse(_view(generation=2), "still missing")
    assert len(incidents) == 2


def test_a_job_started_elsewhere_goes_on_without_this_node_and_a_lost_race_decides_next_round(tmp_path):
    control, incidents = FakeControl(), []
    refusals = JobRefusals(control, node="n1", path=tmp_path / "refused.json", record=incidents.append)
    refusals.refuse(_view(phase="running", nodes={"n0": {}}), "checkpoint_dir missing")
    assert control.calls == [] and "goes on without it" in incidents[0].action
    lost = JobRefusals(FakeControl(wins=False), node="n2", path=tmp_path / "other.json", record=incidents.append)
    lost.refuse(_view(), "script missing")
    assert not lost.refused(_view()) and len(incidents) == 1


def test_node_problems_name_a_missing_script_and_a_checkpoint_dir_whose_parent_is_missing(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    spec = lambda **kw: parse_job_spec({"name": "j", "command": [str(script)], **kw}, "x")  # noqa: E731
    assert node_problems(spec()) == []
    assert node_problems(spec(checkpoint_dir=str(tmp_path / "ckpt"))) == []  # the launcher creates the last part
    [problem] = node_problems(spec(checkpoint_dir=str(tmp_path / "unmounted" / "ckpt")))
    assert "is missing on this node and so is its parent" in problem
    [problem] = node_problems(spec(checkpoint_dir=str(script)))
    assert "is not a directory" in problem
    [problem] = node_problems(parse_job_spec({"name": "j", "command": [str(tmp_path / "gone.py")]}, "x"))
    assert "does not exist" in problem

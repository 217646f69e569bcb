"""Hot spares (issue 47): ``--spare-nodes K`` and the spec's ``spare_nodes`` are validated in one place, passed on
by the daemon, and a spare names itself in the ``node_lost`` incident of the node whose ranks it took. The spare
at work on the multi-node bed: tests/integration/test_spares_bed.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainwarden.agent.common.job_spec import JobSpecError, parse_job_spec, spares_problem
from trainwarden.agent.etcd.keys import job_key
from trainwarden.agent.incidents.record import Incident, IncidentKind, IncidentState
from trainwarden.agent.incidents.spare_takeover import SpareTakeover, taken_over
from trainwarden.agent.launch.run import RunOptions

pytestmark = pytest.mark.timeout(60)

SPEC = {"name": "j", "command": ["train.py"]}


@pytest.mark.parametrize("nnodes, spares, words", [
    ("1", 1, "spares are for jobs of 2 nodes or more (a one-node job restarts on its node); give --nnodes 2 or more"),
    ("1:1", 2, "spares are for jobs of 2 nodes or more"),
    ("2", -1, "--spare-nodes -1: must be a whole number of 0 or more"),
    ("2", 100_000, "at most 100000 nodes in all"),
    ("2:3", 99_998, "at most 100000 nodes in all"),
])
def test_spares_need_two_training_nodes_or_more(nnodes, spares, words):
    assert words in spares_problem(nnodes, spares)
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        RunOptions(script=["t.py"], job="j", nnodes=nnodes, spare_nodes=spares, etcd="e:2379")


@pytest.mark.parametrize("nnodes", ["2", "2:2", "8:8", "1:4", "2:3", "3:8"])
def test_spares_go_with_n_or_min_colon_n_so_a_job_with_no_spare_left_shrinks(nnodes):
    """Issue 47: spares needed N:N, so a job whose last spare was used waited for a node instead of shrinking."""
    assert spares_problem(nnodes, 0) is None
    assert spares_problem(nnodes, 2) is None
    RunOptions(script=["t.py"], job="j", nnodes=nnodes, spare_nodes=2, etcd="e:2379")


def test_the_command_line_refuses_bad_spares_before_starting_anything():
    out = subprocess.run([sys.executable, "-m", "trainwarden.agent.cli", "run", "--nnodes", "1", "--spare-nodes",
                          "1", "--etcd", "127.0.0.1:1", "--", "train.py"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, out.stderr
    assert "trainwarden run: --spare-nodes 1 with --nnodes 1: spares are for jobs of 2 nodes or more" in out.stderr


def test_the_spec_field_is_checked_with_the_specs_names_and_passed_on_to_the_launcher():
    with pytest.raises(JobSpecError, match="job.toml: field 'spare_nodes' 1 with 'nnodes' 1: spares are for jobs of 2 "
                                           "nodes or more"):
        parse_job_spec({**SPEC, "nnodes": "1", "spare_nodes": 1}, "job.toml")
    with pytest.raises(JobSpecError, match="field 'spare_nodes' must be a whole number"):
        parse_job_spec({**SPEC, "nnodes": "2", "spare_nodes": "1"}, "job.toml")
    for nnodes in ("2:2", "2:3"):
        spec = parse_job_spec({**SPEC, "nnodes": nnodes, "spare_nodes": 1}, "job.toml")
        assert spec.spare_nodes == 1
        args = spec.launcher_args()
        assert args[args.index("--spare-nodes") + 1] == "1" and args[args.index("--nnodes") + 1] == nnodes
    assert "--spare-nodes" not in parse_job_spec({**SPEC, "nnodes": "2"}, "x").launcher_args()


def _lost(node="n1", ranks=(2, 3), round_=4, **evidence) -> Incident:
    return Incident(id=f"i-{node}", kind=IncidentKind.NODE_LOST, job="j", node=node, ranks=ranks,
                    evidence={"round": round_, "summary": f"node {node} stopped renewing", **evidence},
                    detected_at=1.0, state=IncidentState.RESOLVED)


def test_the_loss_a_spare_replaced_has_its_ranks_and_the_round_before():
    found = _lost()
    others = [_lost(node="n0", ranks=(0, 1)), _lost(node="n4", round_=2), _lost(node="n5", spare="n9")]
    assert taken_over([*others, found], node="n3", round_=5, ranks=(2, 3)) is found
    assert taken_over([found], node="n3", round_=6, ranks=(2, 3)) is None  # a loss of an older round
    assert taken_over([found], node="n1", round_=5, ranks=(2, 3)) is None  # not itself


class _Etcd:
    def __init__(self):
        self.values: dict[str, bytes] = {}

    def get(self, key):  # the round's leave record (an exclusion the spare replaced): none here
        return self.values.get(key), None

    def get_prefix(self, prefix):
        return [(v, None) for k, v in sorted(self.values.items()) if k.startswith(prefix)]


def test_the_spare_records_the_next_version_of_the_loss_naming_itself_once_the_loss_is_recorded():
    etcd, recorded = _Etcd(), []
    takeover = SpareTakeover(etcd, "j", "n3", lambda i: recorded.append(i) or i, wait_s=5.0, poll_s=0.01)
    takeover.round_started(4, [0, 1])  # a round it trained in from the start: no loss looked for ...
    takeover.round_started(4, [0, 1])
    assert recorded == []
    lost = _lost()
    etcd.values[job_key("j", "incidents", lost.id)] = json.dumps(lost.to_json()).encode()
    named = takeover._name_spare(5, (2, 3))
    assert recorded == [named] and named.id == lost.id
    assert named.evidence["spare"] == "n3" and named.evidence["summary"].startswith("node n1 lost; spare n3 took "
                                                                                    "ranks 2,3")
    assert named.outcome.startswith("spare n3 took ranks 2,3 in round 5")


def test_a_spare_that_finds_no_loss_records_nothing():
    recorded = []
    takeover = SpareTakeover(_Etcd(), "j", "n3", recorded.append, wait_s=0.05, poll_s=0.01)
    assert takeover._name_spare(5, (2, 3)) is None and recorded == []

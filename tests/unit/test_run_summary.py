"""The run summary's incidents line names the first failed rank and counts the collateral."""

import pytest

from trainwarden.agent.incidents import Incident, IncidentKind, IncidentStore
from trainwarden.agent.launch.summary import _incident_summary

pytestmark = pytest.mark.timeout(10)


def test_a_crash_is_summarised_by_its_first_failed_rank_and_the_collateral(tmp_path):
    store = IncidentStore(state_dir=lambda job: tmp_path)
    store.record(Incident(id="20260101T000000000Z-aaaaaa", kind=IncidentKind.CRASH, job="x", node="n", ranks=(5,),
                          evidence={"collateral": [1, 3, 6, 7]}, detected_at=1.0, action="restart"))
    store.record(Incident(id="20260101T000001000Z-bbbbbb", kind=IncidentKind.RESTART, job="x", node="n", ranks=(),
                          evidence={"collateral": [0, 1]}, detected_at=2.0, action="restart"))
    assert _incident_summary(tmp_path) == "crash 1 (rank 5; 4 collateral), restart 1"


def test_a_lost_node_is_named_in_the_summary(tmp_path):
    store = IncidentStore(state_dir=lambda job: tmp_path)
    store.record(Incident(id="20260101T000000000Z-cccccc", kind=IncidentKind.NODE_LOST, job="x", node="n2",
                          ranks=(4, 5), detected_at=1.0))
    assert _incident_summary(tmp_path) == "node_lost 1 (n2: ranks 4,5)"

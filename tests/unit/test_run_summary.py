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


def _summary(tmp_path, progress, *, steps_from, phase):
    import io

    from trainwarden.agent.common.job_lifecycle import JobPhase, JobRecord
    from trainwarden.agent.launch.summary import print_summary

    out = io.StringIO()
    print_summary(out, record=JobRecord(job="x", phase=JobPhase(phase)), state_dir=tmp_path, progress=progress,
                  elapsed=40.0, ckpt_dir=tmp_path / "ckpt", log_path=tmp_path / "run.log", steps_from=steps_from)
    return out.getvalue()


def test_a_restart_of_a_job_without_steps_is_not_called_unrecovered(tmp_path):
    """Seen in tests/integration/test_unchanged_scripts.py: an evaluation loop (collectives only) restarted
    after a hang and succeeded, and the summary said "not recovered" and "0.0s lost": without steps neither
    can be told."""
    from trainwarden.agent.launch.progress import JobProgress

    progress = JobProgress(wall=lambda: 100.0)
    progress.round_started(at=10.0)
    progress.round_failed(at=30.0)
    progress.restarting(after_failure=True)
    progress.round_started(at=32.0)
    text = _summary(tmp_path, progress, steps_from="collectives only", phase="succeeded")
    assert "  restarts     1 (failed before any step, time lost unknown (no steps))\n" in text, text
    assert "not recovered" not in text and "time lost    " not in text, text
    # with steps, a failure no later step passed is still "not recovered"
    progress.step(5, end_wall=20.0, duration_s=0.1)
    text = _summary(tmp_path, progress, steps_from="optimizer hooks", phase="failed")
    assert "  restarts     1 (failed after step 5, not recovered)\n" in text, text
    assert "  time lost    0.0s to failures\n" in text, text


def test_the_summary_says_the_goodput_and_where_the_rest_went(tmp_path):
    import io

    from trainwarden.agent.common.job_lifecycle import JobPhase, JobRecord
    from trainwarden.agent.launch.goodput import GoodputLedger
    from trainwarden.agent.launch.progress import JobProgress
    from trainwarden.agent.launch.summary import print_summary

    ledger = GoodputLedger("x", launched_at=0.0)
    ledger.round_started(0.0)
    for i in range(1, 11):
        ledger.step(i, 4.0 + i, 1.0)  # startup 4 s, ten 1 s steps
    progress = JobProgress(wall=lambda: 100.0)
    progress.step(10, end_wall=14.0, duration_s=1.0)
    out = io.StringIO()
    print_summary(out, record=JobRecord(job="x", phase=JobPhase("succeeded")), state_dir=tmp_path, progress=progress,
                  elapsed=15.0, ckpt_dir=tmp_path / "ckpt", log_path=tmp_path / "run.log", goodput=ledger.snapshot())
    assert "  goodput      71.4% of 14.0s (startup 4.0s)\n" in out.getvalue(), out.getvalue()

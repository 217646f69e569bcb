"""A set-aside checkpoint's incident says which way the restore ended; a blocked resume is one incident."""

from trainwarden.agent.incidents import IncidentKind, IncidentState
from trainwarden.agent.node.checkpoint_incidents import CheckpointIncidents


def recorder():
    latest = {}

    def record(incident):
        latest[incident.id] = incident
        return incident

    return latest, CheckpointIncidents(record, node="n0", wall=lambda: 1000.0)


def test_set_aside_then_resumed_names_the_step():
    latest, incidents = recorder()
    incidents.on_checkpoint("j", 0, "set_aside", 12, "/c/step-00000012.corrupt", 0, "corrupt: bad")
    incidents.on_checkpoint("j", 1, "set_aside", 12, "/c/step-00000012.corrupt", 0, "corrupt: bad")  # same event
    [incident] = latest.values()
    assert incident.state == IncidentState.ACTING
    incidents.on_checkpoint("j", 0, "restored", 8, "/c/step-00000008", 0)
    [incident] = latest.values()
    assert incident.state == IncidentState.RESOLVED and incident.outcome == "the job resumed from step 8"


def test_set_aside_then_blocked_says_the_job_stopped():
    latest, incidents = recorder()
    incidents.on_checkpoint("j", 0, "set_aside", 4, "/c/step-00000004.corrupt", 0, "corrupt: bad")
    incidents.on_checkpoint("j", 0, "resume_blocked", 0, "/c", 0, "none could be loaded")
    by_kind = {i.kind: i for i in latest.values()}
    blocked = by_kind[IncidentKind.RESUME_BLOCKED]
    assert blocked.state == IncidentState.FAILED and "none could be loaded" in blocked.evidence["summary"]
    aside = by_kind[IncidentKind.CHECKPOINT_SET_ASIDE]
    assert aside.state == IncidentState.FAILED and blocked.id in aside.outcome

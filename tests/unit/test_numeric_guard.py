"""The numeric guard (one process, no collective), the `nan` fault, and what the agent makes of a Numeric record:
one incident per event, a counter by kind, a malformed record refused."""

import math

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from trainwarden.agent.incidents import IncidentKind, IncidentState
from trainwarden.agent.metrics.job_collector import JobMetricsCollector
from trainwarden.agent.node.numeric_incidents import NumericIncidents
from trainwarden.agent.proto import telemetry_pb2 as pb
from trainwarden.agent.proto.fault_spec import FaultSpecError, parse_faults
from trainwarden.agent.telemetry.job_telemetry import JobTelemetry, WorkerInfo
from trainwarden.agent.telemetry.server import TelemetryServer
from trainwarden.runtime.faults import FaultInjector
from trainwarden.runtime.numeric import NumericGuard, NumericStop, policy_from_env


class Session:
    def __init__(self):
        self.events = []

    def numeric_event(self, kind, step, *, first_rank, action, detail=""):
        self.events.append((kind, step, first_rank, action, detail))


def model_with_grads(bad=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    loss = model(torch.randn(3, 4)).square().mean()
    loss.backward()
    if bad is not None:
        next(model.parameters()).grad.view(-1)[1] = bad
    return model, loss.detach()


def test_finite_steps_apply_and_report_nothing():
    session = Session()
    guard = NumericGuard(session, policy="rollback")
    model, loss = model_with_grads()
    assert all(guard.check(step, loss=loss, parameters=model.parameters()) for step in range(1, 4))
    assert session.events == [] and guard.events == [] and guard.grad_norm() > 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_gradient_is_rolled_back_and_reported_once(bad):
    session = Session()
    guard = NumericGuard(session, policy="rollback")
    model, loss = model_with_grads(bad)
    assert guard.check(7, loss=loss, parameters=model.parameters()) is False
    [(kind, step, first, action, detail)] = session.events
    assert (kind, step, first, action) == ("nan", 7, 0, "rolled_back")
    assert "gradient norm" in detail and "skips the update" in detail
    assert guard.events[0].where == "gradients"


def test_a_non_finite_loss_is_named_as_the_loss():
    guard = NumericGuard(None, policy="rollback")
    model, loss = model_with_grads()
    assert guard.check(3, loss=loss * math.nan, parameters=model.parameters()) is False
    assert guard.events[0].where == "loss" and guard.rolled_back == 1


def test_nan_again_soon_after_a_rollback_stops_with_both_events_and_later_is_rolled_back_again():
    session = Session()
    guard = NumericGuard(session, policy="rollback", recur_window=10)
    model, loss = model_with_grads(math.nan)
    assert guard.check(5, loss=loss, parameters=model.parameters()) is False
    assert guard.check(16, loss=loss, parameters=model.parameters()) is False  # 11 steps later: another batch
    with pytest.raises(NumericStop) as stop:
        guard.check(20, loss=loss, parameters=model.parameters())
    assert [e.step for e in stop.value.events] == [5, 16, 20]
    assert "again 4 steps after step 16" in str(stop.value)
    assert [e[3] for e in session.events] == ["rolled_back", "rolled_back", "stopped"]


def test_stop_raises_at_once_and_alert_applies_the_update():
    model, loss = model_with_grads(math.nan)
    with pytest.raises(NumericStop, match="numeric policy stop"):
        NumericGuard(None, policy="stop").check(2, loss=loss, parameters=model.parameters())
    session = Session()
    assert NumericGuard(session, policy="alert").check(2, loss=loss, parameters=model.parameters()) is True
    assert session.events[0][3] == "alerted"


def test_no_gradients_and_no_loss_is_a_finite_step():
    assert NumericGuard(None, policy="rollback").check(1, loss=None, parameters=[torch.nn.Parameter(torch.ones(2))])


def test_the_policy_comes_from_the_environment_and_a_bad_one_is_refused():
    assert policy_from_env({}) == "rollback"
    assert policy_from_env({"TRAINWARDEN_NUMERIC_POLICY": "stop"}) == "stop"
    with pytest.raises(ValueError, match="expected one of rollback, stop, alert"):
        policy_from_env({"TRAINWARDEN_NUMERIC_POLICY": "ignore"})
    with pytest.raises(ValueError):
        NumericGuard(None, policy="sometimes")


def test_the_nan_fault_poisons_its_step_once(tmp_path):
    [fault] = parse_faults("nan:rank=1,step=4")
    assert fault.describe() == "nan:rank=1,step=4"
    inj = FaultInjector([fault], rank=1, state_dir=tmp_path)
    inj.step_boundary(3)
    assert not inj.take_poison()
    inj.step_boundary(4)
    assert inj.take_poison() and not inj.take_poison()
    again = FaultInjector([fault], rank=1, state_dir=tmp_path)  # a restarted worker: the marker says it fired
    again.step_boundary(4)
    assert not again.take_poison()
    with pytest.raises(FaultSpecError, match="missing step"):
        parse_faults("nan:rank=1")


def incidents():
    latest = {}

    def record(incident):
        latest[incident.id] = incident
        return incident

    return latest, NumericIncidents(record, node="n0", wall=lambda: 1000.0)


def test_one_incident_per_event_closed_by_what_the_policy_did():
    latest, listener = incidents()
    listener.on_numeric("j", 3, "nan", 12, 3, "rolled_back", "loss nan")
    listener.on_numeric("j", 3, "nan", 12, 3, "rolled_back", "loss nan")  # a replay of the same step
    [incident] = latest.values()
    assert (incident.kind, incident.ranks, incident.state) == (IncidentKind.NUMERIC, (3,), IncidentState.RESOLVED)
    assert incident.evidence["step"] == 12 and "first on rank 3" in incident.evidence["summary"]
    listener.on_numeric("j", 0, "nan", 13, -1, "rolled_back", "every rank's gradients")
    everywhere = [i for i in latest.values() if i.evidence["step"] == 13]
    assert everywhere[0].ranks == () and "on every rank" in everywhere[0].evidence["summary"]
    listener.on_numeric("j", 5, "nan", 14, 5, "stopped", "again")
    stopped = [i for i in latest.values() if i.evidence["step"] == 14]
    assert stopped[0].state == IncidentState.FAILED and "no restart" in stopped[0].outcome


def test_the_agent_counts_numeric_records_by_kind_and_refuses_malformed_ones(tmp_path):
    js = JobTelemetry()
    heard = []

    class Listener:
        def on_step(self, *a):
            pass

        def on_checkpoint(self, *a, **k):
            pass

        def on_numeric(self, *args):
            heard.append(args)

    js.add_listener(Listener())
    server = TelemetryServer(tmp_path / "agent.sock", js)
    info = WorkerInfo(job="num", rank=1, world_size=4, pid=7)
    js.connect(info)
    server._apply(info, pb.WorkerMessage(numeric=pb.Numeric(kind="nan", step=9, first_rank=1, action="rolled_back",
                                                            detail="loss nan")))
    for bad in (pb.Numeric(kind="cosmic_ray", step=9, first_rank=1), pb.Numeric(kind="nan", step=-1, first_rank=1),
                pb.Numeric(kind="nan", step=9, first_rank=4)):
        server._apply(info, pb.WorkerMessage(numeric=bad))
    assert js.rejected()["invalid"] == 3
    assert heard == [("num", 1, "nan", 9, 1, "rolled_back", "loss nan")]
    registry = CollectorRegistry()
    registry.register(JobMetricsCollector(js, node="n0"))
    text = generate_latest(registry).decode()
    assert 'trainwarden_numeric_events_total{job="num",kind="nan",node="n0"} 1.0' in text
    assert 'trainwarden_numeric_events_total{job="num",kind="loss_spike",node="n0"} 0.0' in text

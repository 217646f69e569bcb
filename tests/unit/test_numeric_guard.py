"""The numeric guard (one process, no collective), the `nan` fault, and what the agent makes of a Numeric record:
one incident per event, a counter by kind, a malformed record refused."""

import math
import random

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from trainwarden.agent.incidents import IncidentKind, IncidentState
from trainwarden.agent.metrics.job_collector import JobMetricsCollector
from trainwarden.agent.node.numeric_incidents import NumericIncidents
from trainwarden.agent.shared import telemetry_pb2 as pb
from trainwarden.agent.shared.fault_spec import FaultSpecError, parse_faults
from trainwarden.agent.telemetry.job_telemetry import JobTelemetry, WorkerInfo
from trainwarden.agent.telemetry.server import TelemetryServer
from trainwarden.runtime.faults import FaultInjector
from trainwarden.runtime.numeric import GradientWatch, NumericGuard, NumericStop, SpikeDetector, policy_from_env


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


@pytest.mark.parametrize("bad", [None, math.nan, math.inf])
def test_a_step_that_clips_its_gradients_gives_the_guard_its_norm_and_no_gradient_is_read_again(bad, monkeypatch):
    """``grad_norm``: the norm ``clip_grad_norm_`` returns (before it clips) says what a norm per tensor would; the
    guard computes none of its own (on a GPU, one more read of every gradient is more than the 0.1 % asked)."""
    session = Session()
    guard = NumericGuard(session, policy="rollback")
    model, loss = model_with_grads(bad)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    monkeypatch.setattr(torch, "_foreach_norm", lambda *a, **k: pytest.fail("the guard read the gradients again"))
    applied = guard.check(5, loss=loss, grad_norm=norm)
    if bad is None:
        assert applied and session.events == [] and guard.grad_norm() == pytest.approx(float(norm))
    else:
        assert applied is False and guard.events[0].where == "gradients"
        assert [e[:4] for e in session.events] == [("nan", 5, 0, "rolled_back")]


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


def test_a_sessions_guard_reports_through_it():
    from trainwarden.runtime.session import Session as RuntimeSession

    session = RuntimeSession(job="j", rank=0, world_size=1, client_config=None)  # no agent: a no-op session
    guard = session.numeric_guard(policy="alert")
    model, loss = model_with_grads(math.nan)
    assert isinstance(guard, NumericGuard) and guard.check(1, loss=loss, parameters=model.parameters())


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
    assert inj.take_poison() is None
    inj.step_boundary(4)
    assert math.isnan(inj.take_poison()) and inj.take_poison() is None
    again = FaultInjector([fault], rank=1, state_dir=tmp_path)  # a restarted worker: the marker says it fired
    again.step_boundary(4)
    assert again.take_poison() is None
    with pytest.raises(FaultSpecError, match="missing step"):
        parse_faults("nan:rank=1")
    [spike] = parse_faults("spike:rank=0,step=30,factor=3")
    inj = FaultInjector([spike], rank=0, state_dir=tmp_path)
    inj.step_boundary(30)
    assert inj.take_poison() == 3.0 and spike.describe() == "spike:rank=0,step=30,factor=3.0"
    for bad in ("spike:rank=0,step=3,factor=1", "spike:rank=0,step=3,factor=inf", "spike:rank=0,step=3"):
        with pytest.raises(FaultSpecError):
            parse_faults(bad)


def _series(kind: str, steps: int, seed: int) -> list[float]:
    """Clean loss series of other shapes than the reference job's: falling fast, flat and quiet, small-batch noisy
    (heavy-tailed), a warm-up bump, and slow oscillation (a learning-rate cycle)."""
    rng = random.Random(seed)
    out = []
    for t in range(steps):
        if kind == "falling":
            base, noise = 0.5 + 6 * math.exp(-t / 80), rng.gauss(0, 0.02)
        elif kind == "flat":
            base, noise = 2.0, rng.gauss(0, 0.002)
        elif kind == "noisy":
            base, noise = 3.0, rng.gammavariate(4, 0.1) - 0.4  # small batches: skewed, heavy upper tail
        elif kind == "warmup":
            base, noise = 4.0 + (0.8 * t / 30 if t < 30 else max(0.0, 0.8 - (t - 30) / 50)), rng.gauss(0, 0.03)
        else:  # cyclic
            base, noise = 2.5 + 0.3 * math.sin(t / 40), rng.gauss(0, 0.02)
        out.append(base * (1 + noise))
    return out


@pytest.mark.parametrize("kind", ["falling", "flat", "noisy", "warmup", "cyclic"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_spike_detector_passes_over_clean_series_of_other_shapes(kind, seed):
    detector = SpikeDetector()
    flagged = []
    for step, value in enumerate(_series(kind, 600, seed)):
        limit = detector.limit()
        if limit is not None and value > limit[1]:
            flagged.append((step, value, limit))
        detector.add(value)
    assert flagged == []


@pytest.mark.parametrize("kind", ["falling", "flat", "noisy", "cyclic"])
def test_a_loss_three_times_its_level_is_a_spike_on_each(kind):
    detector = SpikeDetector()
    series = _series(kind, 300, 7)
    for value in series[:250]:
        detector.add(value)
    median, limit = detector.limit()
    assert series[250] <= limit < 3 * series[250], (median, limit, series[250])


def test_a_spike_is_rolled_back_then_a_second_soon_after_applies_and_alert_only_reports():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    session = Session()
    guard = NumericGuard(session, policy="rollback", recur_window=10,
                         spikes=SpikeDetector(window=30, min_history=20))

    def step(index, value):
        model.zero_grad()
        (model(torch.ones(1, 4)).sum() * 0 + value).backward()
        return guard.check(index, loss=torch.tensor(value), parameters=model.parameters())

    assert all(step(i, 2.0 + 0.01 * (i % 3)) for i in range(1, 31))
    assert step(31, 6.0) is False                              # 3x: skipped
    assert step(32, 2.01) is True
    assert step(35, 6.0) is True                               # again within 10 steps: a new level, applied
    assert [(e[0], e[1], e[3]) for e in session.events] == [("loss_spike", 31, "rolled_back"),
                                                            ("loss_spike", 35, "alerted")]
    assert "against a median of 2.01" in session.events[0][4] and "new level" in session.events[1][4]
    alert = NumericGuard(None, policy="stop", spikes=SpikeDetector(window=30, min_history=20))
    for i in range(1, 25):
        alert.check(i, loss=torch.tensor(2.0), parameters=[])
    assert alert.check(25, loss=torch.tensor(9.0), parameters=[]) is True  # a spike never stops a job
    assert alert.events[0].action == "alerted"


def test_the_gradient_watch_reports_a_non_finite_step_once_until_finite_again():
    reports = []
    watch = GradientWatch(lambda step, detail: reports.append((step, detail)))
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    for step, bad in enumerate([None, math.nan, math.inf, None, math.nan], start=1):
        model.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        if bad is not None:
            model.weight.grad[0, 0] = bad
        watch.before_step(optimizer)
        watch.after_step(step)
    assert [s for s, _ in reports] == [2, 5]  # step 3 is the same streak
    assert "not finite" in reports[0][1] and "only watched" in reports[0][1]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # it reads, never writes
    watch.after_step(6)  # a step whose pre-hook did not run (another optimizer): nothing to judge
    assert len(reports) == 2


def test_the_gradient_watch_spaces_its_checks_to_stay_within_its_budget():
    now = [0.0]

    def clock():
        now[0] += 0.001  # a check spans one advance: 1 ms
        return now[0]

    reports = []
    watch = GradientWatch(lambda step, detail: reports.append((step, detail)), budget=0.002, clock=clock)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checked = []
    for step in range(1, 13):
        model.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        if step >= 7:  # NaN from step 7 on, as weights that took one NaN update give
            model.weight.grad[0, 0] = math.nan
        before = now[0]
        watch.before_step(optimizer)
        if now[0] != before:
            checked.append(step)
        watch.after_step(step, 0.1)  # 100 ms steps: 1 ms is 1 %, five times the budget
    assert checked == [1, 6, 11] and watch.every == 5
    assert [s for s, _ in reports] == [11] and "checked every 5 steps" in reports[0][1]


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

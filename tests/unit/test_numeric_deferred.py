"""The numeric guard's deferred check (runtime/numeric_defer.py), forced on the CPU (``defer=True``): torch's fused
AdamW and SGD run there and honour ``found_inf`` as on a GPU. A skipped step leaves the weights and the optimizer's
state (moments, step count) as they were; the event comes at the next check; a NaN back within the window stops one
step late; alert applies; a non-fused optimizer or none keeps the synchronous check. A world of two is stood in for
by a fake collective (the other rank's flags)."""

import math

import pytest
import torch

from trainwarden.runtime.numeric import NumericGuard, NumericStop, SpikeDetector


class Session:
    def __init__(self):
        self.events = []

    def numeric_event(self, kind, step, *, first_rank, action, detail=""):
        self.events.append((kind, step, first_rank, action, detail))


def _fused(model, fused=True):
    return torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01, fused=fused)


def _state(model, optimizer):
    weights = [p.detach().clone() for p in model.parameters()]
    moments = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in model.parameters()]
    return weights, moments


def _same(a, b):
    (wa, ma), (wb, mb) = a, b
    return (all(torch.equal(x, y) for x, y in zip(wa, wb)) and len(ma) == len(mb)
            and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(ma, mb)))


def _train(guard, model, optimizer, step, bad=None, loss_scale=1.0):
    """One step of the loop: backward, the guard's check with the optimizer, its step when the check says so."""
    optimizer.zero_grad(set_to_none=True)
    loss = model(torch.ones(2, 4)).square().mean() * loss_scale
    loss.backward()
    if bad is not None:
        next(model.parameters()).grad.view(-1)[1] = bad
    applied = guard.check(step, loss=loss.detach(), parameters=model.parameters(), optimizer=optimizer)
    if applied:
        optimizer.step()
    return applied


def test_a_deferred_nan_is_skipped_at_its_own_step_and_reported_at_the_next_check():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = _fused(model)
    session = Session()
    guard = NumericGuard(session, policy="rollback", defer=True)
    for step in range(1, 4):
        assert _train(guard, model, optimizer, step)
    before = _state(model, optimizer)
    assert _train(guard, model, optimizer, 4, bad=math.nan) is True  # deferred: step() runs, the device skips
    assert _same(_state(model, optimizer), before)  # weights, moments and step count as before step 4
    assert float(optimizer.state[next(model.parameters())]["step"]) == 3
    assert not hasattr(optimizer, "found_inf")  # taken away after the step: no stale skip for a later step
    assert session.events == [] and guard.events == []  # one step late
    assert _train(guard, model, optimizer, 5)
    [(kind, step, first, action, detail)] = session.events
    assert (kind, step, first, action) == ("nan", 4, 0, "rolled_back")
    assert "gradient norm nan" in detail and "skipped on the device at its own step" in detail
    assert guard.events[0].where == "gradients" and guard.rolled_back == 1
    assert float(optimizer.state[next(model.parameters())]["step"]) == 4  # step 5 applied


def test_a_deferred_nan_back_within_the_window_stops_one_step_late_with_its_update_skipped():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = _fused(model)
    session = Session()
    guard = NumericGuard(session, policy="rollback", recur_window=10, defer=True)
    for step in range(1, 3):
        _train(guard, model, optimizer, step)
    _train(guard, model, optimizer, 3, loss_scale=math.nan)
    _train(guard, model, optimizer, 4)
    before = _state(model, optimizer)
    assert _train(guard, model, optimizer, 5, bad=math.inf) is True
    assert _same(_state(model, optimizer), before)
    with pytest.raises(NumericStop) as stop:
        _train(guard, model, optimizer, 6)
    assert [e.step for e in stop.value.events] == [3, 5] and "again 2 steps after step 3" in str(stop.value)
    assert [(e[1], e[3]) for e in session.events] == [(3, "rolled_back"), (5, "stopped")]
    assert guard.events[0].where == "loss"
    assert _same(_state(model, optimizer), before)  # step 6 raised before its update


def test_a_deferred_alert_applies_the_update_and_flush_reports_the_last_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = _fused(model)
    session = Session()
    guard = NumericGuard(session, policy="alert", defer=True)
    _train(guard, model, optimizer, 1)
    assert _train(guard, model, optimizer, 2, bad=math.nan) is True
    assert torch.isnan(model.weight).any()  # alert: the update applied
    assert session.events == []
    guard.flush()
    assert [(e[1], e[3]) for e in session.events] == [(2, "alerted")]
    guard.flush()  # nothing pending: nothing more
    assert len(session.events) == 1


@pytest.mark.parametrize("given", ["not fused", "none"])
def test_a_non_fused_optimizer_or_none_keeps_the_synchronous_check(given):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = _fused(model, fused=given != "not fused")
    guard = NumericGuard(Session(), policy="rollback", defer=True)
    optimizer.zero_grad()
    model(torch.ones(1, 4)).sum().backward()
    model.weight.grad[0, 0] = math.nan
    passed = optimizer if given == "not fused" else None
    assert guard.check(1, loss=None, parameters=model.parameters(), optimizer=passed) is False  # decided now
    assert guard.events[0].step == 1 and not hasattr(optimizer, "found_inf")


def test_without_defer_a_fused_optimizer_on_the_cpu_keeps_the_synchronous_check():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = _fused(model)
    guard = NumericGuard(Session(), policy="rollback")  # defer=None: deferred on a GPU only
    assert _train(guard, model, optimizer, 1, bad=math.nan) is False
    assert guard.events[0].step == 1 and not hasattr(optimizer, "found_inf")


def test_a_deferred_spike_is_skipped_on_the_device_and_a_second_soon_after_applies():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = _fused(model)
    session = Session()
    guard = NumericGuard(session, policy="rollback", recur_window=10, defer=True,
                         spikes=SpikeDetector(window=30, min_history=20))

    def step(index, value):
        optimizer.zero_grad()
        (model(torch.ones(1, 4)).sum() * 0 + value).backward()
        assert guard.check(index, loss=torch.tensor(value), parameters=model.parameters(), optimizer=optimizer)
        optimizer.step()

    for i in range(1, 31):
        step(i, 2.0 + 0.01 * (i % 3))
    before = _state(model, optimizer)
    step(31, 6.0)                                              # 3x: skipped on the device
    assert _same(_state(model, optimizer), before)
    step(32, 2.01)
    step(35, 6.0)                                              # again within 10 steps: a new level, applied
    applied = _state(model, optimizer)
    assert float(optimizer.state[model.weight]["step"]) == 32
    guard.flush()
    assert [(e[0], e[1], e[3]) for e in session.events] == [("loss_spike", 31, "rolled_back"),
                                                            ("loss_spike", 35, "alerted")]
    assert "against a median of 2.01" in session.events[0][4] and "new level" in session.events[1][4]
    assert _same(_state(model, optimizer), applied)


def test_fused_sgd_with_momentum_checks_its_first_step_synchronously_then_defers():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    guard = NumericGuard(Session(), policy="rollback", defer=True, recur_window=0)  # two NaNs: no stop
    # its first step makes the momentum buffers in the kernel: a skip there would leave them uninitialised
    assert _train(guard, model, optimizer, 1, bad=math.nan) is False and guard.events[0].step == 1
    assert _train(guard, model, optimizer, 2)
    before = _state(model, optimizer)
    assert _train(guard, model, optimizer, 3, bad=math.nan) is True  # buffers made: deferred, skipped on the device
    assert _same(_state(model, optimizer), before) and len(guard.events) == 1
    guard.flush()
    assert [e.step for e in guard.events] == [1, 3]


class _OtherRank:
    """Stands in for the collective of a world of two: the other rank's flags, MIN-reduced into ours."""

    def __init__(self, monkeypatch, rank: int, theirs):
        from trainwarden.runtime import numeric

        self.theirs = theirs  # step -> the other rank's four flags
        self.step = 0
        monkeypatch.setattr(numeric.dist, "is_initialized", lambda: True)
        monkeypatch.setattr(numeric.dist, "get_rank", lambda group=None: rank)
        monkeypatch.setattr(numeric.dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(numeric.dist, "all_reduce", self.all_reduce)

    def all_reduce(self, flags, op=None, group=None):
        flags.copy_(torch.minimum(flags, torch.tensor(self.theirs.get(self.step, [2, 2, -1, 2]))))


def test_a_deferred_nan_on_the_other_rank_is_skipped_here_too_and_named_to_that_rank(monkeypatch):
    other = _OtherRank(monkeypatch, rank=0, theirs={4: [1, 1, 0, 1]})  # rank 1's loss is NaN at step 4
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = _fused(model)
    session = Session()
    guard = NumericGuard(session, policy="rollback", defer=True)
    for step in range(1, 6):
        other.step = step
        before = _state(model, optimizer)
        assert _train(guard, model, optimizer, step)  # this rank's own values are finite at every step
        assert _same(_state(model, optimizer), before) == (step == 4)  # skipped at step 4 on this rank too
    assert [(e.step, e.first_rank, e.where) for e in guard.events] == [(4, 1, "loss")]
    assert session.events == []  # rank 1, the one named, reports it


def test_the_rank_named_reports_a_deferred_nan_at_the_next_check(monkeypatch):
    other = _OtherRank(monkeypatch, rank=1, theirs={})
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = _fused(model)
    session = Session()
    guard = NumericGuard(session, policy="rollback", defer=True)
    for step in range(1, 4):
        other.step = step
        _train(guard, model, optimizer, step, loss_scale=math.nan if step == 2 else 1.0)
        assert [e[:4] for e in session.events] == ([] if step < 3 else [("nan", 2, 1, "rolled_back")])


def test_a_deferred_check_given_the_clipping_norm_skips_a_nan_on_the_device():
    """``grad_norm=``: the norm ``clip_grad_norm_`` returns decides the skip on the device, as the guard's own norms
    would (clipping a NaN norm makes every gradient NaN; the fused optimizer then applies nothing)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    optimizer = _fused(model)
    guard = NumericGuard(None, policy="rollback", spikes=None, defer=True)
    data = torch.randn(8, 16)
    for step in (1, 2):
        optimizer.zero_grad()
        model(data).square().mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0, foreach=True)
        assert guard.check(step, loss=None, grad_norm=norm, optimizer=optimizer)
        optimizer.step()
    optimizer.zero_grad()
    model(data).square().mean().backward()
    next(model.parameters()).grad.view(-1)[3] = math.nan
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0, foreach=True)
    weights, moments = _state(model, optimizer)
    assert guard.check(3, loss=None, grad_norm=norm, optimizer=optimizer) is True
    optimizer.step()
    after, moments_after = _state(model, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(after, weights))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(moments_after, moments) for k in a)
    guard.flush()
    assert [(e.step, e.where, e.action) for e in guard.events] == [(3, "gradients", "rolled_back")]

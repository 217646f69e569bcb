"""The silent-corruption check's decision (runtime/sdc_check.py), every rank's view played by one instance whose
gather returns the other replicas' digests; the real collective runs in tests/integration/test_sdc_check.py."""

import pytest
import torch

from trainwarden.agent.shared.fault_spec import parse_faults
from trainwarden.runtime.faults import FaultInjector, flip_gradient_bit
from trainwarden.runtime.sdc_check import ReplicaProbe, SdcCheck, digest


class Session:
    def __init__(self):
        self.events = []

    def numeric_event(self, kind, step, **fields):
        self.events.append((kind, step, fields))


def _check(me, others, session, ranks=(0, 1, 2)):
    """SdcCheck as rank ``ranks[me]``; ``others(call)`` -> the other replicas' rows of the gather's ``call``-th use."""
    calls = []

    def gather(values):
        rows = others(len(calls))
        calls.append(values)
        return rows[:me] + [values] + rows[me:]

    return SdcCheck(session, every=2, gather=gather, ranks=ranks, rank=ranks[me]), calls


def test_equal_gradients_are_no_event_and_the_check_runs_every_n_steps_on_a_rotating_micro_batch():
    session = Session()
    grads = [torch.arange(6.0)]
    check, _ = _check(0, lambda call: [[digest(grads)], [digest(grads)]], session)
    assert [s for s in range(1, 9) if check.due(s)] == [2, 4, 6, 8]
    assert [check.owner(s) for s in (2, 4, 6, 8)] == [1, 2, 0, 1]
    assert check.check(2, lambda: grads) is None and not session.events and check.checks == 1


def test_a_majority_names_the_rank_outside_it_and_only_that_rank_reports():
    good, bad = [torch.ones(8)], [torch.ones(8)]
    flip_gradient_bit(bad)
    assert digest(good) != digest(bad) and torch.isfinite(bad[0]).all()  # finite: the numeric guard is blind to it
    wrong = Session()
    check, _ = _check(1, lambda call: [[digest(good)], [digest(good)]], wrong, ranks=(4, 5, 6))
    event = check.check(6, lambda: bad)
    assert event.ranks == (5,) and event.resolved
    [(kind, step, fields)] = wrong.events
    assert (kind, step, fields["first_rank"], fields["action"]) == ("sdc", 6, 5, "alerted")
    assert "rank 5 on node" in fields["detail"] and "2 of 3 replicas agree" in fields["detail"]
    right = Session()
    check, _ = _check(0, lambda call: [[digest(bad)], [digest(good)]], right, ranks=(4, 5, 6))
    assert check.check(6, lambda: good).ranks == (5,) and not right.events  # the wrong rank reports, once


def test_two_replicas_that_disagree_recompute_and_a_transient_fault_is_named():
    good = [torch.ones(8)]
    bad = [good[0].clone()]
    flip_gradient_bit(bad)
    session = Session()
    results = iter([bad, good])  # this rank computed wrong once; its recompute is right
    check, calls = _check(1, lambda call: [[digest(good)]] if call == 0 else [[digest(good), digest(good)]],
                          session, ranks=(0, 1))
    event = check.check(4, lambda: next(results))
    assert event.ranks == (1,) and event.resolved and len(calls) == 2
    assert session.events[0][2]["first_rank"] == 1 and "recompute differed" in session.events[0][2]["detail"]


def test_two_replicas_that_each_repeat_their_own_result_are_unresolved():
    a, b = [torch.ones(4)], [torch.full((4,), 2.0)]
    session = Session()
    check, _ = _check(0, lambda call: [[digest(b)]] if call == 0 else [[digest(b), digest(b)]], session,
                      ranks=(0, 1))
    event = check.check(2, lambda: a)
    assert event.ranks == (0, 1) and not event.resolved
    assert session.events[0][2]["first_rank"] == -1 and "third replica" in session.events[0][2]["detail"]


def test_the_gradflip_fault_fires_once_at_its_step_and_its_spec_is_checked():
    [fault] = parse_faults("gradflip:rank=1,step=4")
    injector = FaultInjector([fault], rank=1)
    injector.step_boundary(4)
    assert injector.take_gradflip(4) and not injector.take_gradflip(4)  # the recompute is not corrupted
    with pytest.raises(ValueError, match="step"):
        parse_faults("gradflip:rank=1")
    with pytest.raises(ValueError):
        SdcCheck(every=0, ranks=(0, 1), rank=0, gather=lambda v: [v])


def test_the_replica_probe_computes_the_same_gradient_as_the_model_without_touching_its_grad():
    torch.manual_seed(0)
    model, replica = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    probe = ReplicaProbe(model, replica, lambda out, target: torch.nn.functional.cross_entropy(out, target))
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    probe.load()
    grads = probe.gradients(x, y)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    assert [torch.equal(g, p.grad) for g, p in zip(grads, model.parameters())] == [True, True]
    assert replica.weight.grad is None
    with pytest.raises(ValueError, match="differ"):
        ReplicaProbe(model, torch.nn.Linear(4, 3, bias=False), lambda o, t: o.sum())

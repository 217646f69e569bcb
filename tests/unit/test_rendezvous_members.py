"""The restart round's early close (agent/rendezvous/members.py), on torch's own join operation and state."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

from trainwarden.agent.rendezvous import members
from trainwarden.agent.rendezvous.members import MemberTracker

T0 = datetime(2026, 11, 23, 12, 0, 0, tzinfo=timezone.utc)
A, B, C, D = (dr._NodeDesc(f"n{i}", 100 + i, 0) for i in range(4))


def _settings(min_nodes=2, max_nodes=3, keep_alive=2, attempts=3) -> dr.RendezvousSettings:
    return dr.RendezvousSettings("job", min_nodes, max_nodes, dr.RendezvousTimeout(last_call=timedelta(seconds=30)),
                                 timedelta(seconds=keep_alive), attempts)


def _state(participants, *, heartbeats, round_=1, complete=False, wait_list=()) -> dr._RendezvousState:
    state = dr._RendezvousState()
    state.round = round_
    state.complete = complete
    state.participants = {node: i for i, node in enumerate(participants)}
    state.wait_list = set(wait_list)
    state.last_heartbeats = dict(heartbeats)
    if not complete and len(participants) >= 2:
        state.deadline = datetime.now(timezone.utc) + timedelta(seconds=30)  # torch compares it with the real clock
    return state


class Clock:
    def __init__(self):
        self.now = T0

    def __call__(self):
        return self.now


def _tracker_after_round_of(nodes, clock) -> MemberTracker:
    tracker = MemberTracker(now=clock)
    done = _state(nodes, heartbeats={n: clock.now for n in nodes}, round_=0, complete=True)
    tracker.observe(done)
    tracker.completed(done)
    return tracker


def _join(tracker, node, state, monkeypatch):
    """One step of torch's join operation as ``node`` sees ``state``, inside a tracked next_rendezvous."""
    monkeypatch.setattr(members._active, "tracker", tracker, raising=False)
    return members._JoinOpClosingOnMembers()(dr._RendezvousContext(node, state, _settings()), deadline=1e18)


def test_a_dead_members_round_closes_once_the_survivors_are_back(monkeypatch):
    clock = Clock()
    tracker = _tracker_after_round_of([A, B, C], clock)
    clock.now = T0 + timedelta(seconds=7)  # C's heartbeat is 7 s old: past 2 s x 3, as torch judges it dead
    state = _state([A, B], heartbeats={A: clock.now, B: clock.now})
    assert _join(tracker, A, state, monkeypatch) is dr._Action.MARK_RENDEZVOUS_COMPLETE
    assert tracker.closed_early == 1


def test_a_living_member_that_has_not_rejoined_yet_is_waited_for(monkeypatch):
    """C left the old round (its heartbeat deleted as it left) but has not joined the new one: it is alive."""
    clock = Clock()
    tracker = _tracker_after_round_of([A, B, C], clock)
    clock.now = T0 + timedelta(seconds=2)
    state = _state([A, B], heartbeats={A: clock.now, B: clock.now})  # no heartbeat of C in the state
    assert _join(tracker, A, state, monkeypatch) is not dr._Action.MARK_RENDEZVOUS_COMPLETE
    clock.now = T0 + timedelta(seconds=6, milliseconds=1)  # C never came: dead by torch's rule, stop waiting
    assert _join(tracker, A, state, monkeypatch) is dr._Action.MARK_RENDEZVOUS_COMPLETE


def test_a_node_on_the_wait_list_is_always_waited_for(monkeypatch):
    clock = Clock()
    tracker = _tracker_after_round_of([A, B], clock)
    state = _state([A, B], heartbeats={A: clock.now, B: clock.now, D: clock.now}, wait_list=[D])
    assert _join(tracker, A, state, monkeypatch) is not dr._Action.MARK_RENDEZVOUS_COMPLETE


def test_below_min_nodes_and_first_rounds_keep_torchs_rule(monkeypatch):
    clock = Clock()
    tracker = _tracker_after_round_of([A, B, C], clock)
    clock.now = T0 + timedelta(seconds=7)
    alone = _state([A], heartbeats={A: clock.now})  # B and C dead, min_nodes 2: not enough to train
    assert _join(tracker, A, alone, monkeypatch) is not dr._Action.MARK_RENDEZVOUS_COMPLETE
    first = MemberTracker(now=clock)  # never completed a round: no previous members to go by
    state = _state([A, B], heartbeats={A: clock.now, B: clock.now}, round_=0)
    assert _join(first, A, state, monkeypatch) is not dr._Action.MARK_RENDEZVOUS_COMPLETE


def test_outside_a_tracked_next_rendezvous_the_op_is_torchs(monkeypatch):
    clock = Clock()
    tracker = _tracker_after_round_of([A, B, C], clock)
    clock.now = T0 + timedelta(seconds=7)
    state = _state([A, B], heartbeats={A: clock.now, B: clock.now})
    monkeypatch.setattr(members._active, "tracker", None, raising=False)
    op = members._JoinOpClosingOnMembers()
    assert op(dr._RendezvousContext(A, state, _settings()), 1e18) is not dr._Action.MARK_RENDEZVOUS_COMPLETE
    assert tracker.closed_early == 0


@pytest.mark.parametrize("bad", ["closed", "complete", "not-a-participant"])
def test_a_round_it_cannot_close_is_left_to_torch(bad, monkeypatch):
    clock = Clock()
    tracker = _tracker_after_round_of([A, B, C], clock)
    clock.now = T0 + timedelta(seconds=7)
    state = _state([A, B], heartbeats={A: clock.now, B: clock.now})
    node = A
    if bad == "closed":
        state.closed = True
    elif bad == "complete":
        state.complete = True
    else:
        node = D
    assert _join(tracker, node, state, monkeypatch) is not dr._Action.MARK_RENDEZVOUS_COMPLETE

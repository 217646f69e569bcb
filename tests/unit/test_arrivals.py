import pytest

from trainwarden.agent.telemetry.arrivals import Arrival, ArrivalMatcher, Interval

pytestmark = pytest.mark.timeout(30)
S = 1_000_000_000


def _matcher(members=None):
    m = ArrivalMatcher(expire_s=10)
    for group, ranks in (members or {"tp": [0, 1]}).items():
        m.set_members(group, ranks)
    return m


def test_the_last_arrival_is_the_departure_and_the_rest_waited():
    m = _matcher()
    # rank 0 arrives at collectives 0 and 1 at 1 s and 2 s; rank 1 at 1.4 s and 2.1 s
    m.add(0, [Arrival("tp", 0, 1 * S), Arrival("tp", 1, 2 * S)], continues=False)
    m.resolve([0, 1])
    assert m.take() == {}                       # collective 0 waits for rank 1
    m.add(1, [Arrival("tp", 0, int(1.4 * S)), Arrival("tp", 1, int(2.1 * S))], continues=False)
    m.resolve([0, 1])
    got = m.take()
    # rank 0: 1 s from its arrival at 0 to its arrival at 1, of which 0.4 s waiting for rank 1
    assert got[0] == [Interval(2 * S, 1 * S, int(0.6 * S))]
    # rank 1: arrived last at 0, so its 0.7 s interval is all its own work
    assert got[1] == [Interval(int(2.1 * S), int(0.7 * S), int(0.7 * S))]
    assert m.pending() == {0: 1, 1: 1}          # each rank's latest arrival waits for its successor


def test_groups_are_matched_only_among_local_members():
    m = _matcher({"dp": [0, 2], "tp": [0, 1]})
    m.add(0, [Arrival("dp", 0, 1 * S), Arrival("tp", 0, 2 * S), Arrival("tp", 1, 3 * S)], continues=False)
    m.add(1, [Arrival("tp", 0, int(2.5 * S)), Arrival("tp", 1, 3 * S)], continues=False)
    m.resolve([0, 1])                           # rank 2 runs on another node
    got = m.take()
    # dp -> tp: dp has no other local member, so that interval is not judged
    assert got[0] == [Interval(3 * S, 1 * S, int(0.5 * S))]
    assert got[1] == [Interval(3 * S, int(0.5 * S), int(0.5 * S))]


def test_a_gap_in_a_ranks_arrivals_makes_no_interval_across_it():
    m = _matcher()
    m.add(0, [Arrival("tp", 0, 1 * S)], continues=False)
    m.add(1, [Arrival("tp", 0, 1 * S)], continues=False)
    m.add(0, [Arrival("tp", 5, 6 * S), Arrival("tp", 6, 7 * S)], continues=False)   # 1..4 were lost
    m.add(1, [Arrival("tp", 1, 2 * S), Arrival("tp", 5, 6 * S), Arrival("tp", 6, 7 * S)], continues=True)
    m.resolve([0, 1])
    got = m.take()
    assert got[0] == [Interval(7 * S, 1 * S, 1 * S)]
    # rank 1: 0 -> 1 is judged; 1 -> 5 is not (rank 0 is past collective 1 and never reported it)
    assert got[1] == [Interval(2 * S, 1 * S, 1 * S), Interval(7 * S, 1 * S, 1 * S)]
    assert m.pending() == {0: 1, 1: 1}


def test_a_member_that_never_reports_is_given_up_after_expiry():
    m = _matcher()
    m.add(0, [Arrival("tp", i, i * S) for i in range(15)], continues=False)
    m.resolve([0, 1])
    assert m.take() == {} and m.pending()[0] == 11   # the 4 more than 10 s old were dropped


def test_unknown_groups_and_reset():
    m = _matcher()
    m.add(0, [Arrival("other", 0, 1 * S), Arrival("other", 1, 2 * S)], continues=False)
    m.resolve([0, 1])
    assert m.take() == {} and m.pending()[0] == 1
    m.reset()
    assert m.pending() == {}
    m.add(0, [Arrival("tp", 0, 1 * S), Arrival("tp", 1, 2 * S)], continues=False)
    m.add(1, [Arrival("tp", 0, 1 * S), Arrival("tp", 1, 2 * S)], continues=False)
    m.resolve([0, 1])
    assert set(m.take()) == {0, 1}             # members survive a reset


def test_a_collective_a_member_skipped_is_given_up_as_soon_as_it_reports_a_later_one():
    m = _matcher()
    m.add(0, [Arrival("tp", 0, 1 * S), Arrival("tp", 1, 2 * S), Arrival("tp", 2, 3 * S)], continues=False)
    m.add(1, [Arrival("tp", 0, 1 * S)], continues=False)
    m.resolve([0, 1])
    assert [i.end_ns for i in m.take()[0]] == [2 * S]   # collective 1: rank 1 has not got there yet
    m.add(1, [Arrival("tp", 2, 3 * S)], continues=False)  # rank 1 lost its entry for collective 1
    m.resolve([0, 1])
    assert m.pending()[0] == 1 and 0 not in m.take()      # given up at once, not after expire_s

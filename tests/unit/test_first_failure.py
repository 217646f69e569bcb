"""The first failed rank and its collateral, decided from synthetic failure records of several shapes."""

import pytest

from trainwarden.agent.incidents.first_failure import first_failure, says_peer_gone

pytestmark = pytest.mark.timeout(10)


def failed(rank, code, *, error=None, at=None):
    return {"global_rank": rank, "exitcode": code, **({"error": error} if error else {}),
            **({"exited_at": at} if at is not None else {})}


def stream(rank, at, goodbye=None):
    return {"rank": rank, "ended_at": at, "goodbye": goodbye}


def test_a_sigkill_beats_the_exit_codes_of_the_peers_it_took_down():
    verdict = first_failure([failed(1, 1), failed(3, 1), failed(5, -9), failed(6, 1), failed(7, 1)])
    assert verdict.first == (5,) and verdict.collateral == (1, 3, 6, 7)
    assert verdict.why.startswith("rank 5 (SIGKILL") or verdict.why.startswith("rank 5 (signal 9")


def test_peers_that_said_goodbye_before_the_killed_ranks_stream_broke_are_still_collateral():
    ended = [stream(1, 10.00, "peer gone: Connection closed by peer"), stream(5, 10.20),
             stream(3, 10.25, "peer gone: Connection closed by peer")]
    verdict = first_failure([failed(1, 1), failed(3, 1), failed(5, -9)], ended)
    assert verdict.first == (5,) and verdict.collateral == (1, 3)


def test_of_several_signals_the_earliest_exit_is_first():
    verdict = first_failure([failed(6, -9, at=10.5), failed(2, -11, at=10.0), failed(0, 1, at=10.7)])
    assert verdict.first == (2,) and verdict.collateral == (0, 6)
    assert "exited first of the 2" in verdict.why


def test_several_signals_and_no_times_names_them_all():
    verdict = first_failure([failed(6, -9), failed(2, -6), failed(0, 1)])
    assert verdict.first == (2, 6) and verdict.collateral == (0,)
    assert "unknown" in verdict.why


def test_an_error_of_its_own_beats_errors_that_say_a_peer_is_gone():
    verdict = first_failure([failed(0, 1, error="DistBackendError: Connection closed by peer [10.0.0.2]:4"),
                             failed(1, 1, error="ValueError: bad shape"),
                             failed(2, 1, error="RuntimeError: [pair.cc:553] Connection reset by peer")])
    assert verdict.first == (1,) and verdict.collateral == (0, 2)


def test_no_error_files_no_signals_the_earliest_exit():
    verdict = first_failure([failed(3, 1, at=5.4), failed(0, 1, at=5.1), failed(1, 1, at=5.3)])
    assert verdict.first == (0,) and verdict.collateral == (1, 3)


def test_no_evidence_at_all_names_every_failed_rank_rather_than_guess():
    verdict = first_failure([failed(3, 1), failed(0, 1)])
    assert verdict.first == (0, 3) and verdict.collateral == ()


def test_every_rank_here_left_for_a_peer_elsewhere():
    verdict = first_failure([failed(0, 1), failed(1, 1)], [stream(0, 1.0, "peer gone: reset"),
                                                           stream(1, 1.1, "peer gone: reset")])
    assert verdict.first == () and verdict.collateral == (0, 1)
    assert "the failed rank is on another node" in verdict.why


def test_nothing_failed_is_no_verdict():
    assert first_failure([]) is None


def test_last_words():
    assert says_peer_gone("peer gone: x") and says_peer_gone("DistNetworkError: timed out")
    assert not says_peer_gone("ValueError: bad shape") and not says_peer_gone(None)

import pytest

from trainwarden.runtime.peer_failure import peer_failure

pytestmark = pytest.mark.timeout(10)


def test_gloo_peer_loss_in_cause_chain():
    try:
        try:
            raise RuntimeError("[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:24499. This is typically ...")
        except RuntimeError as inner:
            raise RuntimeError("\n[Stage 1] failed to run forward") from inner
    except RuntimeError as exc:
        assert peer_failure(exc) == "Connection closed by peer [127.0.0.1]:24499."


def test_own_error_is_not_a_peer_failure():
    assert peer_failure(ValueError("shape mismatch")) is None


def test_dist_error_types_by_name():
    class DistNetworkError(RuntimeError):
        pass

    assert peer_failure(DistNetworkError("")) == "DistNetworkError"

"""gRPC's blocking waits, made patient on the threads that ask for it (the telemetry sender's, agent_client.py).

gRPC's synchronous stack waits for a response in slices of 0.1 s (``grpc._common.wait``), so that a *main* thread
blocked in a call still runs its signal handlers (grpc/grpc#19464). The sender thread reads the agent's commands
that way all the time: ten wake-ups a second, each taking the GIL from the training thread, the largest share of the
idle stream's cost (issue 14). Signal handlers run only on the main thread, so elsewhere the slices buy nothing.
"""

from __future__ import annotations

import threading

__all__ = ["wait_patiently_on_this_thread"]

_PATIENT_WAIT_S = 30.0
_patient = threading.local()


def wait_patiently_on_this_thread() -> bool:
    """From now on, on the calling thread, a gRPC wait with no timeout and no spin callback sleeps until gRPC
    notifies its condition (a response, the end of the call, a cancel), or 30 s, instead of waking every 0.1 s.
    Every other thread, and every other kind of wait, goes to gRPC's own function unchanged. Returns False (and
    changes nothing) when this gRPC has no such function."""
    try:
        from grpc import _common as common
    except ImportError:
        return False
    stock = getattr(common, "wait", None)
    if stock is None:
        return False
    if not getattr(stock, "_trainwarden_patient", False):
        def wait(wait_fn, wait_complete_fn, timeout=None, spin_cb=None):
            if timeout is None and spin_cb is None and getattr(_patient, "on", False):
                while not wait_complete_fn():
                    wait_fn(timeout=_PATIENT_WAIT_S)
                return False
            return stock(wait_fn, wait_complete_fn, timeout, spin_cb)

        wait._trainwarden_patient = True  # type: ignore[attr-defined]
        common.wait = wait
    _patient.on = True
    return True

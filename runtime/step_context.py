"""The training step's hot path: the contexts ``Session.step()`` and ``Session.phase()`` return (runtime/session.py).

Two clock reads on entering a step, one on leaving it and a tuple appended to the client's bounded deque; nothing
here raises into the step (an exception from the training step passes through untouched). Durations use the
monotonic clock; the wall-clock start is kept to line steps up with the Flight Recorder's enqueue times. They
read and write the session's own step state (``_phases``, ``_hold_after``, ``_cuda``): they are its inside, kept
apart so the hot path reads on one screen.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .agent_client import STEP_RECORD

if TYPE_CHECKING:
    from .session import Session

__all__ = ["NULL_CONTEXT", "NullContext", "PhaseContext", "StepContext"]


class NullContext:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


NULL_CONTEXT = NullContext()
"""What ``step()`` and ``phase()`` return without an agent: nothing to do."""


class StepContext:
    """``Session.step(index)``: times the step and streams its record; holds before it when a checkpoint with
    ``hold`` asked for that (``Session._hold``)."""

    __slots__ = ("_session", "_index", "_tokens", "_wall", "_mono", "_gpu")

    def __init__(self, session: "Session", index: int, tokens: int) -> None:
        self._session, self._index, self._tokens = session, index, tokens

    def __enter__(self):
        s = self._session
        if s._hold_after is not None and self._index > s._hold_after:
            s._hold(self._index)
        s._phases = None
        self._gpu = s._gpu_begin()
        self._wall = time.time_ns()
        self._mono = time.monotonic_ns()
        return self

    def __exit__(self, exc_type, exc, tb):
        s = self._session
        if exc_type is not None:  # a step that raised did not complete: it is not progress
            s._phases = None
            if s._cuda is not None:
                s._cuda.abandon(self._gpu)
            return False
        try:
            s._emit_step((STEP_RECORD, self._index, self._wall, time.monotonic_ns() - self._mono, self._tokens,
                          s._phases), self._gpu)
            s._phases = None
        except Exception:
            pass
        return False


class PhaseContext:
    """``Session.phase(name)``: adds the phase's seconds to the current step's record."""

    __slots__ = ("_session", "_name", "_mono")

    def __init__(self, session: "Session", name: str) -> None:
        self._session, self._name = session, name

    def __enter__(self):
        self._mono = time.monotonic_ns()
        return self

    def __exit__(self, *exc):
        try:
            s = self._session
            phases = s._phases if s._phases is not None else {}
            phases[self._name] = phases.get(self._name, 0.0) + (time.monotonic_ns() - self._mono) / 1e9
            s._phases = phases
        except Exception:
            pass
        return False

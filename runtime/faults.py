"""Fault injection: named faults scheduled per (rank, step), driven by ``TRAINWARDEN_FAULTS``.

The specification is a ``;``-separated list of ``KIND:key=value,...`` entries, for example::

    crash:rank=3,step=12;stop:rank=1,step=40;hang:rank=2,step=30;slow:rank=0,from=10,until=60,factor=1.3

Kinds (all checked at step boundaries, before the step's first collective):

``crash``  SIGKILL of the rank's own process at the start of ``step``.
``stop``   SIGSTOP of the rank's own process at the start of ``step`` (a frozen process: it holds its
           sockets and memory but makes no progress, like a rank wedged in the kernel).
``hang``   the rank blocks forever at the start of ``step``, outside any collective, so its peers wait
           inside that step's first collective for a rank that never comes.
``slow``   from step ``from`` (inclusive) until step ``until`` (exclusive; absent = forever) the rank waits
           ``(factor - 1) x`` its previous step's duration (less the delay injected into that step, so
           the delay does not compound: factor 2 is twice as slow, not ever slower) at each boundary: it
           arrives late at every
           collective, which is what a thermally throttled GPU or a bad link does to its peers. The delay
           is a sleep, not busy work, so on a CPU-only machine it slows this rank without stealing cores
           from its peers.
``exception`` raises ``InjectedFault`` at the start of ``step`` (a Python error in user code).
``slow_save`` the checkpoint save after ``step`` blocks the step for ``seconds`` more (checked by
           ``before_save``; slow storage or a stuck staging copy, which the watchdog must not take for
           a hang).

Common keys: ``rank`` (global rank; required), ``step``, ``repeat=1`` (fire again after a restart).

A fault fires once per job, not again after torchrun restarts the workers: before it fires, the rank
writes a marker file under ``$TRAINWARDEN_STATE_DIR/faults/`` (the launcher sets it to the job's state
directory). Without a state directory (plain torchrun), a one-shot fault fires only in the first round
(``TORCHELASTIC_RESTART_COUNT == 0``). ``slow`` is a window, not an event, and ignores both.

Unknown kinds, unknown keys and malformed values raise ``FaultSpecError`` at start-up, naming the
offending entry, so a typo never silently turns a fault test into a clean run.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from trainwarden.agent.proto.contract import STATE_DIR_ENV

logger = logging.getLogger(__name__)

__all__ = ["ENV_VAR", "Fault", "FaultInjector", "FaultSpecError", "InjectedFault", "parse_faults"]

ENV_VAR = "TRAINWARDEN_FAULTS"

# kind -> (required keys, optional keys)
_KINDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "crash": (frozenset({"rank", "step"}), frozenset({"repeat"})),
    "stop": (frozenset({"rank", "step"}), frozenset({"repeat"})),
    "hang": (frozenset({"rank", "step"}), frozenset({"repeat"})),
    "exception": (frozenset({"rank", "step"}), frozenset({"repeat"})),
    "slow": (frozenset({"rank", "from", "factor"}), frozenset({"until"})),
    "slow_save": (frozenset({"rank", "step", "seconds"}), frozenset({"repeat"})),
}


class FaultSpecError(ValueError):
    """``TRAINWARDEN_FAULTS`` is malformed. Not retryable: fix the specification."""


class InjectedFault(RuntimeError):
    """Raised by the ``exception`` fault."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One scheduled fault."""

    index: int
    """Position in the specification; names the fault's once-per-job marker."""
    kind: str
    """One of crash, stop, hang, exception, slow, slow_save."""
    rank: int
    """Global rank the fault applies to."""
    step: int | None = None
    """Step at whose start a one-shot fault fires."""
    start: int | None = None
    """First slowed step (``slow``)."""
    until: int | None = None
    """First step no longer slowed (``slow``); None = never ends."""
    factor: float = 1.0
    """Step-time multiplier (``slow``)."""
    seconds: float = 0.0
    """Extra blocking time of the save (``slow_save``)."""
    repeat: bool = False
    """Fire again after a restart."""

    def describe(self) -> str:
        if self.kind == "slow":
            end = "" if self.until is None else f",until={self.until}"
            return f"slow:rank={self.rank},from={self.start}{end},factor={self.factor}"
        if self.kind == "slow_save":
            return f"slow_save:rank={self.rank},step={self.step},seconds={self.seconds}"
        return f"{self.kind}:rank={self.rank},step={self.step}"


def _int(entry: str, key: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise FaultSpecError(f"fault {entry!r}: {key}={value!r} is not an integer") from None
    if number < 0:
        raise FaultSpecError(f"fault {entry!r}: {key} must be >= 0, got {number}")
    return number


def parse_faults(spec: str) -> list[Fault]:
    """Parse a specification string; raise ``FaultSpecError`` naming the first bad entry."""
    faults: list[Fault] = []
    for index, entry in enumerate(e.strip() for e in spec.split(";")):
        if not entry:
            continue
        kind, sep, rest = entry.partition(":")
        kind = kind.strip()
        if kind not in _KINDS:
            raise FaultSpecError(
                f"fault {entry!r}: unknown kind {kind!r}; known kinds: {', '.join(sorted(_KINDS))}"
            )
        required, optional = _KINDS[kind]
        values: dict[str, str] = {}
        for item in filter(None, (i.strip() for i in rest.split(","))) if sep else ():
            key, eq, value = item.partition("=")
            if not eq or not value:
                raise FaultSpecError(f"fault {entry!r}: expected key=value, got {item!r}")
            if key not in required | optional:
                allowed = ", ".join(sorted(required | optional))
                raise FaultSpecError(f"fault {entry!r}: unknown key {key!r} for {kind}; allowed: {allowed}")
            values[key] = value
        missing = required - values.keys()
        if missing:
            raise FaultSpecError(f"fault {entry!r}: missing {', '.join(sorted(missing))}")
        if kind == "slow":
            try:
                factor = float(values["factor"])
            except ValueError:
                raise FaultSpecError(f"fault {entry!r}: factor={values['factor']!r} is not a number") from None
            if not factor >= 1.0:
                raise FaultSpecError(f"fault {entry!r}: factor must be >= 1.0, got {factor}")
            start = _int(entry, "from", values["from"])
            until = _int(entry, "until", values["until"]) if "until" in values else None
            if until is not None and until <= start:
                raise FaultSpecError(f"fault {entry!r}: until ({until}) must be greater than from ({start})")
            faults.append(Fault(index=index, kind=kind, rank=_int(entry, "rank", values["rank"]),
                                start=start, until=until, factor=factor))
        else:
            seconds = 0.0
            if kind == "slow_save":
                try:
                    seconds = float(values["seconds"])
                except ValueError:
                    raise FaultSpecError(f"fault {entry!r}: seconds={values['seconds']!r} is not a number") from None
                if not seconds > 0:
                    raise FaultSpecError(f"fault {entry!r}: seconds must be > 0, got {seconds}")
            repeat = values.get("repeat", "0")
            if repeat not in ("0", "1"):
                raise FaultSpecError(f"fault {entry!r}: repeat must be 0 or 1, got {repeat!r}")
            faults.append(Fault(index=index, kind=kind, rank=_int(entry, "rank", values["rank"]),
                                step=_int(entry, "step", values["step"]), seconds=seconds,
                                repeat=repeat == "1"))
    return faults


class FaultInjector:
    """The faults of one rank, checked at every step boundary.

    ``step_boundary`` is on the training step's hot path: with no fault for this rank it is a single
    emptiness check.
    """

    def __init__(
        self,
        faults: list[Fault],
        *,
        rank: int,
        state_dir: str | os.PathLike | None = None,
        restart_count: int = 0,
        kill=os.kill,
        sleep=time.sleep,
        block=None,
    ) -> None:
        self.rank = rank
        self._faults = [f for f in faults if f.rank == rank]
        self._marker_dir = Path(state_dir) / "faults" if state_dir else None
        self._restart_count = restart_count
        self._kill = kill
        self._sleep = sleep
        self._block = block or (lambda: threading.Event().wait())  # forever: only a signal ends it
        self._injected = 0.0  # seconds of delay injected at the last step boundary
        if self._faults:
            logger.warning("rank %d: fault injection armed: %s", rank,
                           "; ".join(f.describe() for f in self._faults))

    @classmethod
    def from_env(cls, *, rank: int, env: Mapping[str, str] | None = None) -> "FaultInjector":
        env = os.environ if env is None else env
        spec = env.get(ENV_VAR, "")
        try:
            restart_count = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        except ValueError:
            restart_count = 0
        return cls(parse_faults(spec) if spec else [], rank=rank,
                   state_dir=env.get(STATE_DIR_ENV) or None, restart_count=restart_count)

    @property
    def armed(self) -> bool:
        return bool(self._faults)

    def step_boundary(self, step: int, last_step_seconds: float | None = None) -> None:
        """Fire whatever is due at the start of ``step``. Call before the step's first collective."""
        if not self._faults:
            return
        injected, self._injected = self._injected, 0.0
        for fault in self._faults:
            if fault.kind == "slow":
                if last_step_seconds and fault.start <= step and (fault.until is None or step < fault.until):
                    delay = (fault.factor - 1.0) * max(0.0, last_step_seconds - injected)
                    self._sleep(delay)
                    self._injected += delay
            elif fault.kind != "slow_save" and fault.step == step and self._claim(fault):
                self._fire(fault, step)

    def before_save(self, step: int) -> None:
        """Call when the checkpoint save of ``step`` starts: a due ``slow_save`` blocks here."""
        for fault in self._faults:
            if fault.kind == "slow_save" and fault.step == step and self._claim(fault):
                logger.warning("rank %d: injecting fault %s", self.rank, fault.describe())
                self._sleep(fault.seconds)

    def _claim(self, fault: Fault) -> bool:
        """True if this one-shot fault may fire now; records that it has (before it fires)."""
        if fault.repeat:
            return True
        if self._marker_dir is None:
            return self._restart_count == 0
        marker = self._marker_dir / f"fired-{fault.index}-{fault.kind}-rank{fault.rank}-step{fault.step}"
        try:
            self._marker_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(f"{time.time():.3f} pid={os.getpid()}\n")
            f.flush()
            os.fsync(f.fileno())
        return True

    def _fire(self, fault: Fault, step: int) -> None:
        logger.warning("rank %d: injecting fault %s at step %d", self.rank, fault.describe(), step)
        for handler in logging.getLogger().handlers:
            handler.flush()
        if fault.kind == "crash":
            self._kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "stop":
            self._kill(os.getpid(), signal.SIGSTOP)
        elif fault.kind == "hang":
            self._block()
        elif fault.kind == "exception":
            raise InjectedFault(f"injected fault {fault.describe()} at step {step}")

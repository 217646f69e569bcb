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
``nan``    the rank's loss of ``step`` is not a number (the training loop asks ``take_poison()`` and multiplies
           its loss by NaN; the reference job poisons its gradients instead on a rank that computes no loss, a
           pipeline stage before the last): what an overflow or a bad batch does, for the numeric guard
           (runtime/numeric.py) to catch.
``spike``  the rank's loss of ``step`` is ``factor`` times what it is (and so are its gradients): a loss spike.
``slow_save`` the checkpoint save after ``step`` blocks the step for ``seconds`` more (checked by
           ``before_save``; slow storage or a stuck staging copy, which the watchdog must not take for
           a hang).
``snapflip`` one byte in the middle of the largest floating-point tensor of the rank's first memory
           snapshot of ``step`` or later is inverted once the file is written and its sums recorded
           (``after_snapshot``, which the ``Checkpointer`` calls on its writer thread; once a process):
           host memory gone bad, for the restore's checksum verification (runtime/checkpoint/memory_sums.py) to find.
           The copy sent to a peer node is sent from the same file after this, so it carries the flip too.

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
from pathlib import Path
from typing import Mapping

from trainwarden.agent.shared.contract import STATE_DIR_ENV
from trainwarden.agent.shared.fault_spec import ENV_VAR, Fault, FaultSpecError, parse_faults

logger = logging.getLogger(__name__)

__all__ = ["ENV_VAR", "Fault", "FaultInjector", "FaultSpecError", "InjectedFault", "parse_faults"]

class InjectedFault(RuntimeError):
    """Raised by the ``exception`` fault."""


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
        self._poison: float | None = None  # a `nan` or `spike` fault fired at this step's boundary: the loss's factor
        self._flipped: set[int] = set()  # the snapflip faults that fired in this process
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
            elif fault.kind not in ("slow_save", "snapflip") and fault.step == step and self._claim(fault):
                self._fire(fault, step)

    def take_poison(self) -> float | None:
        """Once after a ``nan`` or ``spike`` fault fired at the last step boundary: what to multiply this step's loss
        by (NaN, or the spike's factor); None otherwise."""
        poison, self._poison = self._poison, None
        return poison

    def before_save(self, step: int) -> None:
        """Call when the checkpoint save of ``step`` starts: a due ``slow_save`` blocks here."""
        for fault in self._faults:
            if fault.kind == "slow_save" and fault.step == step and self._claim(fault):
                logger.warning("rank %d: injecting fault %s", self.rank, fault.describe())
                self._sleep(fault.seconds)

    def after_snapshot(self, step: int, path: str) -> None:
        """Call when the memory snapshot of ``step`` is written to ``path``: a due ``snapflip`` corrupts it."""
        for fault in self._faults:
            if fault.kind == "snapflip" and step >= fault.step and fault.index not in self._flipped \
                    and self._claim(fault):
                self._flipped.add(fault.index)  # once a process, even where no marker says so (plain torchrun)
                where = _flip_a_tensor_byte(path)
                logger.warning("rank %d: injecting fault %s: inverted the byte at %d of %s (step %d)", self.rank,
                               fault.describe(), where, path, step)

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
        elif fault.kind == "nan":
            self._poison = float("nan")
        elif fault.kind == "spike":
            self._poison = fault.factor
        elif fault.kind == "exception":
            raise InjectedFault(f"injected fault {fault.describe()} at step {step}")


def _flip_a_tensor_byte(path: str) -> int:
    """Invert the middle byte of the largest floating-point tensor of the snapshot file ``path`` in place; its
    offset."""
    from trainwarden.runtime.checkpoint.memory_snapshot import MappedSnapshot  # torch: only where the fault fires

    snapshot = MappedSnapshot(path)
    # a weight or an optimizer moment rather than the RNG state: the largest floating-point tensor
    _, _, offset, nbytes = max(snapshot.header["tensors"], key=lambda entry: ("float" in entry[0], entry[3]))
    snapshot.close()
    where = offset + nbytes // 2
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, where)[0] ^ 0xFF]), where)
    finally:
        os.close(fd)
    return where

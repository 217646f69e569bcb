"""GPU step times from CUDA events, resolved off the training thread.

On CUDA the CPU enqueues kernels and runs ahead of the GPU, so a step timed with the CPU's clock is its
enqueue time: short while the CPU is ahead, and then one step absorbs the GPU's backlog when something
waits for it. A GPU step longer than the agent's hang deadline would read as a hang. The step's GPU time is
the span between two CUDA events recorded on the current stream at the step's boundaries.

`CudaStepTimer` keeps that off the hot path:

- The training thread, at a step's start, takes a pair of events from a bounded pool of reused ones and
  records the first (`begin`); at its end, records the second and queues the step's record behind it
  (`end`). Recording an event enqueues a marker on the stream: no synchronize, no allocation, no wait.
- A resolver thread takes the queued steps in order, polls ``end.query()`` until the GPU has passed the
  marker, reads ``start.elapsed_time(end)`` (both complete by then, so it does not block), hands the record
  on with that duration, and returns the pair to the pool.
- When the pool is empty (the CPU is more than `pool_size` steps ahead), or an event call fails (a CUDA
  error is sticky), the step keeps its CPU duration and is counted in `cpu_timed`; records still leave
  in step order. Nothing raises into the step.

So the agent hears of a step when the GPU has finished it, with the GPU's duration: progress and step
times are the GPU's. The event API is a constructor parameter (`new_event`; tests pass a fake with torch's
``record()``, ``query()`` and ``elapsed_time(end)``).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from typing import Any, Callable

__all__ = ["CudaStepTimer", "cuda_in_use", "gpu_uuid"]

log = logging.getLogger(__name__)

POOL_SIZE = 16
"""Event pairs kept: the steps the CPU may run ahead of the GPU before steps fall back to CPU time."""
POLL_S = 0.002
"""How often the resolver asks the oldest queued step's end event whether the GPU has passed it."""


def cuda_in_use() -> bool:
    """True when this process has initialized CUDA (never initializes it, never imports torch)."""
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:
        return False


def gpu_uuid() -> str:
    """The current CUDA device's UUID as NVML and nvidia-smi spell it ("GPU-" + 8-4-4-4-12 hex); "" when
    CUDA is not in use. torch's `_CUuuid` prints without the prefix (torch/csrc/cuda/Module.cpp)."""
    if not cuda_in_use():
        return ""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    except Exception:
        return ""
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def _torch_event() -> Any:
    import torch

    return torch.cuda.Event(enable_timing=True)


class CudaStepTimer:
    """Times steps on the GPU (module docstring). ``emit(record)`` receives each step record, in order,
    with its duration (index 3 of the record, in ns) replaced by the GPU's; it runs on the resolver thread."""

    def __init__(self, emit: Callable[[tuple], None], *, new_event: Callable[[], Any] | None = None,
                 pool_size: int = POOL_SIZE, poll_s: float = POLL_S) -> None:
        if pool_size < 1:
            raise ValueError(f"CudaStepTimer: pool_size must be >= 1, got {pool_size}")
        new_event = new_event or _torch_event
        self._emit = emit
        self._poll_s = poll_s
        self._free: deque = deque((new_event(), new_event()) for _ in range(pool_size))
        self._pending: deque = deque()  # (pair or None, record), in step order
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.resolved = 0
        """Steps timed on the GPU."""
        self.cpu_timed = 0
        """Steps that kept their CPU duration (pool empty, or an event call failed)."""
        self._failed_once = False
        self._thread = threading.Thread(target=self._run, name="trainwarden-cuda-steps", daemon=True)
        self._thread.start()

    # ---- training thread (hot path: never raises, never waits) --------------------------------------------

    def begin(self) -> Any:
        """At a step's start: a token for `end` (None when no event pair is free)."""
        try:
            pair = self._free.popleft()
        except IndexError:
            return None
        try:
            pair[0].record()
        except Exception as exc:
            self._failed(exc)
            self._free.append(pair)
            return None
        return pair

    def end(self, token: Any, record: tuple) -> None:
        """At a step's end: queue its record behind the GPU's end of the step (token from `begin`)."""
        if token is not None:
            try:
                token[1].record()
            except Exception as exc:
                self._failed(exc)
                self._free.append(token)
                token = None
        self._pending.append((token, record))
        self._wake.set()

    def abandon(self, token: Any) -> None:
        """A step that raised: its pair goes back to the pool (its start event may still be pending on the
        stream; recording it again later re-arms it)."""
        if token is not None:
            self._free.append(token)

    # ---- resolver thread ---------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        return len(self._pending)

    def close(self, timeout: float = 2.0) -> bool:
        """Resolve what is queued for up to ``timeout`` seconds, then stop; True when nothing was left."""
        self._wake.set()
        deadline = time.monotonic() + timeout
        while self._pending and self._thread.is_alive() and time.monotonic() < deadline:
            self._stop.wait(self._poll_s)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=max(0.1, deadline - time.monotonic()))
        return not self._pending

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._resolve_ready():
                    if self._pending:
                        self._stop.wait(self._poll_s)
                    else:
                        self._wake.wait(0.5)
                        self._wake.clear()
            except Exception as exc:  # survive one bad iteration (STYLE 8)
                log.warning("cuda step timer: %s", exc)
                self._stop.wait(self._poll_s)

    def _resolve_ready(self) -> bool:
        """Hand on every queued step the GPU has finished, oldest first; True when one was."""
        done = False
        while self._pending:
            token, record = self._pending[0]
            duration_ns = None
            if token is not None:
                try:
                    if not token[1].query():
                        return done
                    duration_ns = int(token[0].elapsed_time(token[1]) * 1e6)
                except Exception as exc:
                    self._failed(exc)
                self._free.append(token)
            self._pending.popleft()
            if duration_ns is None:
                self.cpu_timed += 1
            else:
                self.resolved += 1
                record = record[:3] + (duration_ns,) + record[4:]
            self._emit(record)
            done = True
        return done

    def _failed(self, exc: BaseException) -> None:
        if not self._failed_once:
            self._failed_once = True
            log.warning("CUDA step timing: an event call failed (%s); such steps keep their CPU time", exc)

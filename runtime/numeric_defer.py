"""The numeric guard's deferred mode: the skip decided on the device, the flags read one step later.

The synchronous check (runtime/numeric.py) reads its four flags on the host before the optimizer step: on a GPU that
read waits for the backward pass, and the optimizer's kernels are launched only after it, no longer overlapping the
GPU's work (+0.55 % of a 129 ms step on an H200, issue 48). With a fused optimizer the guard need not read anything:
torch's fused Adam, AdamW and SGD take ``optimizer.found_inf`` (the tensor ``GradScaler`` sets) and skip the update
on the device when it is 1, undoing Adam's step count. So the deferred check computes and all-reduces the same flags
on the device, turns them into that 0/1 tensor, and copies them to the host without blocking (a pinned buffer and a
CUDA event); the guard reads them at its next check, when they are long done.

What is one step late: the events, the incident and ``NumericStop`` (a NaN back within the recurrence window stops the
job at the check after it). What is not: the update of a step with a non-finite value (or a loss spike under
``rollback``) is skipped on every rank at its own step, so no NaN reaches the weights, the optimizer's state or a
checkpoint taken after that step.

``DeviceSkip`` hands the flag to the optimizer; ``HostCopy`` and ``Pending`` carry the flags to the next check.
``found_inf`` is how torch's fused optimizers take a skip (a documented attribute of ``GradScaler``'s contract, read in
``torch.optim.adam``/``sgd``); this module is the one place that sets it. Not with a ``GradScaler`` on the same
optimizer: its ``step`` sets and removes ``found_inf`` itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DeviceSkip", "HostCopy", "Pending", "skips_on_device"]

_FUSED_SKIPPERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def skips_on_device(optimizer: torch.optim.Optimizer) -> str | None:
    """None when ``optimizer``'s next step honours ``found_inf`` on the device; else why it does not (the guard then
    checks that step synchronously)."""
    if not isinstance(optimizer, _FUSED_SKIPPERS):
        return f"{type(optimizer).__name__} is not torch's Adam, AdamW or SGD"
    if not all(group.get("fused") for group in optimizer.param_groups):
        return f"{type(optimizer).__name__} is not fused (fused=True): it ignores found_inf"
    if isinstance(optimizer, torch.optim.SGD) and any(group["momentum"] for group in optimizer.param_groups):
        # fused SGD's first step makes its momentum buffers with empty_like and fills them in the kernel: a skipped
        # first step would leave them uninitialised for the next
        for group in optimizer.param_groups:
            if any(optimizer.state.get(p, {}).get("momentum_buffer") is None for p in group["params"]
                   if p.grad is not None):
                return "fused SGD has no momentum buffers yet (its first step)"
    return None


class DeviceSkip:
    """Hands one optimizer the step's skip flag as ``GradScaler`` does (``optimizer.found_inf``, a float32 0/1 tensor
    on the device) and takes it away again after the step (a step post-hook), so a later step without the guard never
    sees a stale one."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._flag: torch.Tensor | None = None
        self._hook = optimizer.register_step_post_hook(self._after_step)

    def arm(self, skip: torch.Tensor) -> None:
        """``skip``: 1.0 (skip the update) or 0.0, float32, on the parameters' device."""
        self._flag = skip
        self.optimizer.found_inf = skip

    def _after_step(self, optimizer, args, kwargs) -> None:
        if self._flag is not None and getattr(optimizer, "found_inf", None) is self._flag:
            del optimizer.found_inf
        self._flag = None

    def close(self) -> None:
        self._after_step(self.optimizer, (), {})
        self._hook.remove()


@dataclass
class Pending:
    """One step's agreed flags (and this rank's loss) on their way to the host, read at the next check."""

    step: int
    values: torch.Tensor
    """The four flags, then the loss (float64); a host tensor once ``event`` is done."""
    event: torch.cuda.Event | None
    limit: tuple[float, float] | None
    """The spike limit the step was judged against."""
    has_loss: bool

    def read(self) -> tuple[list[int], float | None]:
        if self.event is not None:
            self.event.synchronize()  # recorded before this step's optimizer kernels: long done by the next check
        values = self.values.tolist()
        return [int(v) for v in values[:4]], values[4] if self.has_loss else None


class HostCopy:
    """Copies a step's flags and loss to the host without blocking: one pinned buffer on a GPU (read before it is
    reused: the next check reads it first), the tensor itself on the CPU."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None  # reused as the buffer is: recorded again once read

    def send(self, step: int, flags: torch.Tensor, value: torch.Tensor | None,
             limit: tuple[float, float] | None) -> Pending:
        loss = value.detach().reshape(1).to(flags.device) if value is not None else flags.new_zeros(1)
        packed = torch.cat([flags.to(torch.float64), loss.to(torch.float64)])
        if packed.device.type != "cuda":
            return Pending(step, packed, None, limit, value is not None)
        if self._buffer is None:
            self._buffer = torch.empty(5, dtype=torch.float64, pin_memory=True)
            self._event = torch.cuda.Event()
        self._buffer.copy_(packed, non_blocking=True)
        self._event.record()
        return Pending(step, self._buffer, self._event, limit, value is not None)

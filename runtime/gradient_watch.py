"""The gradient watch of unchanged scripts (runtime/auto.py): detection only, a step late on a GPU, within a budget.

``NumericGuard`` (runtime/numeric.py) is the check a training loop calls itself, and the one that rolls back.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch

__all__ = ["GradientWatch"]


def _local(grad: torch.Tensor) -> torch.Tensor:
    to_local = getattr(grad, "to_local", None)  # a DTensor's own shard: no collective
    return to_local() if to_local is not None else grad


class GradientWatch:
    """Detection only, for an unchanged script (runtime/auto.py): is what the primary optimizer is about to apply
    finite? Auto-instrumentation may not change what a script computes, so nothing is skipped or stopped: a step
    whose gradients are not finite is one ``numeric`` incident ("alerted"), and the next after the gradients were
    finite again another. ``NumericGuard`` in the loop is what rolls back.

    ``before_step`` (the optimizer's pre-hook, on the training thread) takes a norm per gradient tensor of the
    optimizer's parameters on their device and keeps whether all were finite, as a tensor: nothing waits for a GPU.
    ``after_step`` (the post-hook, with the step's index and duration) reads the flag of the step before on a GPU
    (long finished by then: no stall) or this step's on the CPU, and reports.

    Budget: a check reads every gradient once (about 0.7 of an SGD step's time on the CPU: tests/bench/
    bench_numeric.py --watch), which a small model's short step would feel. So the watch checks every ``every``-th
    step, ``every`` chosen from its own measured time and the step's so that it takes at most ``budget`` (0.2 %) of
    the training thread. A NaN in the gradients stays in the weights (an update with it makes them NaN, and every
    later gradient with them), so a sparser check finds it as surely, up to ``every`` - 1 steps later: the report
    says how far apart the checks were. Each rank judges its own gradients, with no collective
    (none may be added to an unchanged script): after a data-parallel all-reduce every rank sees the same NaN, and the
    incidents of one step count once.
    """

    def __init__(self, report: Callable[[int, str], None], *, budget: float = 0.002,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._report, self._budget, self._clock = report, budget, clock
        self._flag: torch.Tensor | None = None  # this step's: all gradients finite
        self._pending: tuple[torch.Tensor, int] | None = None  # a GPU step's flag, read at the next step
        self._reported = False  # quiet until the gradients are finite again
        self.every = 1
        """Check every this many steps (from the measured cost and step time: the class docstring)."""
        self._skip = 0  # steps until the next check
        self._cost = self._step_s = 0.0  # moving averages: one check's seconds, one step's

    def before_step(self, optimizer) -> None:
        if self._skip > 0:
            self._skip -= 1
            return
        began = self._clock()
        grads = [_local(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self._flag = torch.isfinite(torch.stack(torch._foreach_norm(grads))).all() if grads else None
        spent = self._clock() - began
        self._cost = spent if not self._cost else 0.8 * self._cost + 0.2 * spent
        self._skip = -1  # checked: after_step sets the next interval

    def after_step(self, index: int, step_seconds: float = 0.0) -> None:
        if step_seconds > 0:
            self._step_s = step_seconds if not self._step_s else 0.9 * self._step_s + 0.1 * step_seconds
        if self._skip == -1:
            self.every = max(1, math.ceil(self._cost / (self._budget * self._step_s))) if self._step_s else 1
            self._skip = self.every - 1
        flag, self._flag = self._flag, None
        if flag is not None and flag.device.type != "cpu":  # judge the step before's: done on the GPU by now
            previous, self._pending = self._pending, (flag, index)
            if previous is None:
                return
            flag, index = previous
        if flag is None:
            return
        if bool(flag):
            self._reported = False
        elif not self._reported:
            self._reported = True
            apart = (f" (checked every {self.every} steps, to take at most {100 * self._budget:g} % of the step: it "
                     f"arose within the {self.every - 1} steps before)" if self.every > 1 else "")
            self._report(index, f"the gradients the optimizer applied were not finite (NaN or Inf){apart}; an "
                                "unchanged script is only watched: the update applied and the weights may be NaN from "
                                "here on (trainwarden.runtime.numeric.NumericGuard in the loop rolls such a step back)")

"""The numeric guard: a non-finite loss or gradient, or a loss spike, never reaches the model's weights unnoticed.

    guard = rt.numeric_guard()                     # NumericGuard(rt); the policy from trainwarden run's
                                                   # --numeric-policy (TRAINWARDEN_NUMERIC_POLICY)
    for step in ...:
        loss = forward_backward(...)               # gradients in .grad
        if guard.check(step, loss=local_loss, parameters=model.parameters()):
            optimizer.step()                       # False: the step's update is skipped (rolled back)
    guard.flush()                                  # a deferred check's last step (below); a no-op otherwise

``check`` runs between the backward pass and the optimizer step, on every rank, every step. Each rank looks at
its own loss (before any reduction across ranks: the rank that computed it is the one to name) and the norms of
its own gradients (the local shards of DTensors), and the ranks agree through one ``all_reduce`` (MIN) of four
integers: the lowest rank whose loss was not finite, the lowest whose gradients were not, whether every rank's
gradients were not (negated: 0 when none was finite), and the lowest rank whose loss spiked. Every rank then
takes the same decision, so no collective is left half-done. A rank whose own loss was not finite is the one
named; when no loss was but every rank's gradients are (a data-parallel all-reduce in the backward pass spreads
one rank's NaN to all), the event says so rather than blame rank 0.

What a non-finite value leads to (``NUMERIC_POLICIES``, from ``--numeric-policy``):

``rollback`` (default)  the update is skipped on every rank. Because the check comes before the optimizer step,
    the state before the step is still in place (model, optimizer moments, step counter): going back to it is
    free, with no snapshot to read. The step's batch is not trained on; training goes on with the next step.
    No NaN can reach a checkpoint. A non-finite value again within ``RECUR_WINDOW`` steps of a rollback
    means the state or the machine is at fault, not a batch: the job stops (``NumericStop``) with both events
    as evidence, rather than skip batch after batch.
``stop``    ``NumericStop`` at once.
``alert``   the incident only; the update applies (the weights may become NaN).

Loss spikes: each rank with a loss also judges it against its own recent losses (``SpikeDetector``: above the
rolling median by more than 8 robust standard deviations and 25 %); the same collective carries the lowest rank
whose loss spiked. Under ``rollback`` a spike's update is skipped like a NaN's; a second spike within
``RECUR_WINDOW`` steps of a rolled-back one applies (the loss moved to a new level: skipping more batches would not
bring it back) and joins the history; under ``alert`` and ``stop`` a spike is only reported: it never stops a job.

The rank named first (its own loss, else its gradients, was not finite; or its loss spiked) reports a ``Numeric``
record to the agent: one ``numeric`` incident per event, counted in ``trainwarden_numeric_events_total``.
``NumericStop`` is for the training script to let out of its loop; the reference job exits with
``EXIT_NUMERIC_STOP``, which the launcher does not restart.

Cost: a norm per gradient tensor (``torch._foreach_norm``, in place on their device), the spike test and one
collective of four integers per step (a step that computes its gradients' norm anyway, to clip them, passes it as
``grad_norm`` and saves the norms); ``tests/bench/bench_numeric.py`` measures it against the same loop
without the guard. On a GPU the check's read of its flags is a synchronization: the host waits for the backward
pass before it launches the optimizer's kernels (+0.55 % of a 129 ms H200 step). With a fused optimizer
(``check(..., optimizer=opt)``, torch's Adam, AdamW or SGD with ``fused=True``) the check is deferred instead
(runtime/numeric_defer.py): the same flags decide the skip on the device, through the optimizer's ``found_inf``,
``check`` returns True without waiting, and the flags are read at the next check (or ``flush()``, when the loop
ends). One step late: the events, the incident and ``NumericStop`` (a NaN back within ``RECUR_WINDOW`` stops the job
at the check after it). Not late: the skip itself, at its own step on every rank, so no NaN reaches the weights, the
optimizer's state or a checkpoint. Without an optimizer, with one that is not fused, or on the CPU (unless
``defer=True``), the check stays synchronous, unchanged.
"""

from __future__ import annotations

import logging
import os
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
import torch.distributed as dist

from trainwarden.agent.shared.contract import NUMERIC_POLICIES, NUMERIC_POLICY_ENV
from trainwarden.runtime.gradient_watch import GradientWatch  # re-exported: its home before
from trainwarden.runtime.numeric_defer import DeviceSkip, HostCopy, Pending, skips_on_device

__all__ = ["GradientWatch", "NumericEvent", "NumericGuard", "NumericStop", "RECUR_WINDOW", "SpikeDetector",
           "policy_from_env"]

log = logging.getLogger(__name__)

RECUR_WINDOW = 10
"""A non-finite value within this many steps after a rollback stops the job instead of rolling back again."""


class SpikeDetector:
    """Upward loss spikes, against the rank's own recent losses: a loss is a spike when it is above the median of the
    last ``window`` kept losses by more than ``k`` robust standard deviations (1.4826 x the median absolute
    deviation) and by more than ``rel`` of the median. Nothing is judged before ``min_history`` losses are in.

    Only upward: a loss that falls fast (early training) is never one, and the median of a falling series lags above
    it. The relative floor keeps a flat, quiet series (a tiny deviation) from calling every wobble a spike. The
    defaults (50 steps, 20 before judging, k 8, 25 %) passed over the reference job's and the tests' other jobs'
    clean series (tests/unit/test_numeric_guard.py) and caught a loss 3x its level.
    """

    def __init__(self, *, window: int = 50, min_history: int = 20, k: float = 8.0, rel: float = 0.25) -> None:
        if not 1 < min_history <= window or k <= 0 or rel < 0:
            raise ValueError(f"spike detector: need 1 < min_history <= window, k > 0, rel >= 0; got {min_history}, "
                             f"{window}, {k}, {rel}")
        self._values: deque[float] = deque(maxlen=window)
        self._min_history, self._k, self._rel = min_history, k, rel
        self._limit: tuple[float, float] | None = None  # (median, limit), worked out once per added loss

    def add(self, value: float) -> None:
        """A kept step's loss (finite, its update applied)."""
        self._values.append(value)
        self._limit = None

    def limit(self) -> tuple[float, float] | None:
        """(median, the loss above which a step is a spike), or None while the history is short."""
        if len(self._values) < self._min_history:
            return None
        if self._limit is None:
            median = statistics.median(self._values)
            spread = 1.4826 * statistics.median(abs(v - median) for v in self._values)
            self._limit = (median, median + max(self._k * spread, self._rel * abs(median)))
        return self._limit

    @property
    def history(self) -> int:
        return len(self._values)


@dataclass(frozen=True)
class NumericEvent:
    """One step whose values were not finite (or whose loss spiked), as every rank agreed."""

    step: int
    first_rank: int
    """The lowest rank whose own loss was not finite, else the lowest whose gradients were not."""
    where: str
    """"loss" or "gradients": what was not finite on ``first_rank``."""
    action: str
    """"rolled_back", "stopped" or "alerted"."""
    everywhere: bool = False
    """The gradients were not finite on every rank of the group (no rank's loss was): where it arose is unknown."""
    kind: str = "nan"
    """"nan" (not finite) or "loss_spike"."""

    def describe(self) -> str:
        if self.kind == "loss_spike":
            return f"loss spike at step {self.step}, first on rank {self.first_rank}"
        if self.everywhere:
            return (f"non-finite gradients at step {self.step} on every rank (after their all-reduce: the rank they "
                    "came from cannot be told)")
        return f"non-finite {self.where} at step {self.step}, first on rank {self.first_rank}"


class NumericStop(RuntimeError):
    """The job must stop: its values are not finite and the policy (or a NaN back after a rollback) says so."""

    def __init__(self, message: str, events: tuple[NumericEvent, ...]) -> None:
        super().__init__(message)
        self.events = events


def policy_from_env(env: Mapping[str, str] | None = None) -> str:
    """The policy ``trainwarden run`` gave the workers (default ``rollback``); a bad value is a ``ValueError``."""
    value = (os.environ if env is None else env).get(NUMERIC_POLICY_ENV, "") or "rollback"
    if value not in NUMERIC_POLICIES:
        raise ValueError(f"{NUMERIC_POLICY_ENV}={value!r}: expected one of {', '.join(NUMERIC_POLICIES)}")
    return value


def _local(grad: torch.Tensor) -> torch.Tensor:
    to_local = getattr(grad, "to_local", None)  # a DTensor's own shard: no collective
    return to_local() if to_local is not None else grad


class NumericGuard:
    """Checks every step's loss and gradients before its update (see the module's docstring).

    ``session``: the ``trainwarden.runtime`` session the event is reported through (None: logged only).
    ``group``: the process group the ranks agree in (default: the world).
    ``defer``: the deferred check (``check``'s ``optimizer``). None (default): with a fused optimizer on a GPU;
    True: on the CPU too (tests; torch's fused AdamW runs there); False: never.
    """

    def __init__(self, session=None, *, policy: str | None = None, group=None, device: torch.device | None = None,
                 recur_window: int = RECUR_WINDOW, spikes: SpikeDetector | None | bool = True,
                 defer: bool | None = None) -> None:
        self.policy = policy_from_env() if policy is None else policy
        if self.policy not in NUMERIC_POLICIES:
            raise ValueError(f"numeric policy {self.policy!r}: expected one of {', '.join(NUMERIC_POLICIES)}")
        self._session = session
        self._group = group
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._world = dist.get_world_size(group) if dist.is_initialized() else 1
        self._device = device
        self._recur_window = recur_window
        self.spikes = SpikeDetector() if spikes is True else spikes or None
        """Judges this rank's losses for spikes (None: no spike detection)."""
        self.events: list[NumericEvent] = []
        self._norms: list[torch.Tensor] = []
        self._answers: tuple[torch.Tensor, torch.Tensor] | None = None  # the flags when finite, when not
        self._defer = defer
        self._skip: DeviceSkip | None = None  # the deferred mode's: the optimizer it hands the skip to
        self._copy = HostCopy()
        self._pending: Pending | None = None  # a deferred step's flags, read at the next check
        self._told: set = set()  # optimizers logged as checked synchronously

    @property
    def rolled_back(self) -> int:
        return sum(1 for e in self.events if e.action == "rolled_back")

    def grad_norm(self) -> float:
        """This rank's own gradient norm at the last check (reads the device: not on the hot path)."""
        return float(torch.linalg.vector_norm(torch.stack(self._norms))) if self._norms else 0.0

    def _flags(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._answers is None or self._answers[0].device != device:
            # the third: -1 where this rank's gradients are finite, so that the MIN is 0 only when no rank's are
            finite = torch.tensor([self._world, self._world, -1, self._world], dtype=torch.int64, device=device)
            not_finite = torch.tensor([self._rank, self._rank, 0, self._rank], dtype=torch.int64, device=device)
            self._answers = (finite, not_finite)
        return self._answers

    def check(self, step: int, *, loss: torch.Tensor | None, parameters: Iterable[torch.nn.Parameter] = (),
              optimizer: torch.optim.Optimizer | None = None, grad_norm: torch.Tensor | None = None) -> bool:
        """True: apply the step's update. False: skip it (``rollback``). Raises ``NumericStop``. Collective: every
        rank of the group calls it at every step.

        ``optimizer``: the optimizer whose step follows. A fused Adam, AdamW or SGD on a GPU (or on the CPU with
        ``defer=True``) makes the check deferred (runtime/numeric_defer.py): the skip is decided on the device, the
        call returns True (call ``optimizer.step()``: it applies nothing when the step is skipped) without waiting for
        the GPU, and this step's events, incident and stop come at the next check or ``flush()``.

        ``grad_norm``: a norm of the step's gradients that it computes anyway (``clip_grad_norm_``'s return value,
        before it clips: any NaN or Inf element makes it so). The guard then reads that one value instead of a norm per
        gradient tensor, which is all it adds to the step: on an H200 one read of 537 MB of gradients is 0.14 % of a
        126 ms step (BENCHMARKS.md), more than the 0.1 % asked of the whole check. ``parameters`` are not read. Where
        the norm is reduced across ranks (FSDP, tensor parallelism) every rank sees a NaN, and the event says every
        rank's gradients were not finite rather than name one; a rank's own loss still names it."""
        self._settle()  # a deferred step before this one: its events first (they decide this step's spike rules)
        if grad_norm is not None:
            grads, norms = [], [grad_norm.detach()]
        else:
            grads, norms = [_local(p.grad) for p in parameters if p.grad is not None], None
        device = self._device or (grads[0].device if grads else grad_norm.device if grad_norm is not None else
                                  loss.device if loss is not None else torch.device("cpu"))
        flags, value, limit = self._agree(grads, loss, device, norms)
        if self._deferred(optimizer, device):
            return self._skip_on_device(step, flags, value, limit, optimizer)
        return self._decide(step, [int(v) for v in flags.tolist()], value, limit)

    def flush(self) -> None:
        """Read a deferred step's flags now (its events, incident, ``NumericStop``): when the loop ends, or before
        reading ``events``. Nothing to do after a synchronous check."""
        self._settle()

    def _agree(self, grads: list[torch.Tensor], loss: torch.Tensor | None, device: torch.device,
               norms: list[torch.Tensor] | None = None):
        """The four flags every rank agreed on (on the device, not read), this rank's loss, and its spike limit.
        ``norms``: the step's own norm of its gradients (``check``'s ``grad_norm``), else one per tensor of `grads`."""
        if norms is not None:
            self._norms = norms
            grad_ok = torch.isfinite(norms[0]).all().to(device)
        elif grads:  # a norm per tensor, in place on its device; any NaN or Inf element makes its norm so
            self._norms = torch._foreach_norm(grads)
            grad_ok = torch.isfinite(torch.stack(self._norms)).all()
        else:
            self._norms, grad_ok = [], torch.ones((), dtype=torch.bool, device=device)
        yes = torch.ones((), dtype=torch.bool, device=device)
        value = loss.detach().float().mean() if loss is not None else None
        loss_ok = torch.isfinite(value).to(device) if value is not None else yes
        limit = self.spikes.limit() if self.spikes is not None and value is not None else None
        calm = (value <= limit[1]).to(device) if limit is not None else yes  # NaN is not calm: not finite wins below
        finite, not_finite = self._flags(device)
        flags = torch.where(torch.stack([loss_ok, grad_ok, grad_ok, calm]), finite, not_finite)
        if self._world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self._group)
        return flags, value, limit

    def _decide(self, step: int, flags: list[int], value, limit: tuple[float, float] | None, *,
                late: bool = False) -> bool:
        """What the agreed flags lead to: the events, the incident, ``NumericStop``; True to apply the update.
        ``value``: this rank's loss (a tensor, or a float read a step late: ``late``)."""
        first_loss, first_grad, none_finite, first_spike = flags
        if first_loss < self._world:
            return self._act(step, first_loss, "loss", value, late=late)
        if first_grad < self._world:
            everywhere = self._world > 1 and none_finite == 0
            return self._act(step, first_grad, "gradients", value, everywhere=everywhere, late=late)
        applied = True if first_spike >= self._world else self._spike(step, first_spike, value, limit)
        if applied and value is not None and self.spikes is not None:
            self.spikes.add(float(value))
        return applied

    def _deferred(self, optimizer: torch.optim.Optimizer | None, device: torch.device) -> bool:
        if optimizer is None or self._defer is False or (device.type != "cuda" and self._defer is not True):
            return False
        why_not = skips_on_device(optimizer)
        if why_not is not None:
            if optimizer not in self._told:
                self._told.add(optimizer)
                log.info("numeric guard: the synchronous check for this optimizer (%s)", why_not)
            return False
        return True

    def _skip_on_device(self, step: int, flags: torch.Tensor, value: torch.Tensor | None,
                        limit: tuple[float, float] | None, optimizer: torch.optim.Optimizer) -> bool:
        """The skip decided on the device, as ``_decide`` will decide it a step later: a non-finite value skips
        under ``rollback`` and ``stop`` (whose stop comes at the next check), a spike under ``rollback`` unless
        one was rolled back within the window (the events up to the step before are in: ``_settle``)."""
        if self._skip is None or self._skip.optimizer is not optimizer:
            if self._skip is not None:
                self._skip.close()
            self._skip = DeviceSkip(optimizer)
        if self.policy != "alert":
            lowest = flags[:2].amin()
            if self.policy == "rollback" and not self._recurred("loss_spike", step)[1]:
                lowest = torch.minimum(lowest, flags[3])
            self._skip.arm((lowest < self._world).to(torch.float32))
        self._pending = self._copy.send(step, flags, value, limit)
        return True

    def _settle(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            flags, value = pending.read()
            self._decide(pending.step, flags, value, pending.limit, late=True)

    def _recurred(self, kind: str, step: int) -> tuple[NumericEvent | None, bool]:
        """The last rolled-back event of ``kind``, and whether ``step`` is within the window after it."""
        previous = next((e for e in reversed(self.events) if e.kind == kind and e.action == "rolled_back"), None)
        return previous, previous is not None and step - previous.step <= self._recur_window

    def _spike(self, step: int, first: int, value: torch.Tensor | None, limit: tuple[float, float] | None) -> bool:
        """A loss spike on ``first`` (the lowest rank whose loss spiked): skipped under ``rollback`` unless the last
        spike was rolled back within ``recur_window`` steps (then the loss has moved to a new level: it applies and
        joins the history); reported only under ``alert`` and ``stop`` (a spike never stops a job)."""
        previous, recurred = self._recurred("loss_spike", step)
        action = "rolled_back" if self.policy == "rollback" and not recurred else "alerted"
        event = NumericEvent(step=step, first_rank=first, where="loss", action=action, kind="loss_spike")
        self.events.append(event)
        if self._rank == first:
            seen = (f"loss {float(value):g} against a median of {limit[0]:g} over the last {self.spikes.history} "
                    f"steps (a spike above {limit[1]:g})" if value is not None and limit is not None else "")
            why = ("every rank skips the update (numeric policy rollback)" if action == "rolled_back" else
                   f"the update applies: the loss spiked again {step - previous.step} steps after step "
                   f"{previous.step} was rolled back, a new level rather than one batch" if recurred else
                   f"the update applies (numeric policy {self.policy})")
            detail = f"{seen}; {why}"
            log.warning("rank %d: %s: %s", self._rank, event.describe(), detail)
            if self._session is not None:
                self._session.numeric_event("loss_spike", step, first_rank=first, action=action,
                                            detail=f"{event.describe()}: {detail}")
        return action != "rolled_back"

    def _act(self, step: int, first: int, where: str, value, *, everywhere: bool = False, late: bool = False) -> bool:
        previous, recurred = self._recurred("nan", step)
        action = {"rollback": "stopped" if recurred else "rolled_back", "stop": "stopped", "alert": "alerted"}[
            self.policy]
        event = NumericEvent(step=step, first_rank=first, where=where, action=action, everywhere=everywhere)
        self.events.append(event)
        # the detail reads the device (the loss, the norms): only the rank that reports it, or every rank that stops
        needed = self._rank == first or action == "stopped"
        detail = self._detail(event, value, previous if recurred else None) if needed else ""
        if late and detail:
            detail += (" (read at the next check: the update was skipped on the device at its own step)"
                       if action != "alerted" else " (read at the next check)")
        if self._rank == first:
            log.error("rank %d: %s; %s", self._rank, event.describe(), detail)
            if self._session is not None:
                self._session.numeric_event("nan", step, first_rank=-1 if everywhere else first, action=action,
                                            detail=f"{event.describe()}; {detail}")
        if action == "stopped":
            raise NumericStop(f"{event.describe()}: {detail}", tuple(self.events))
        if action == "rolled_back" and self._rank == 0:
            log.warning("step %d's update skipped on every rank (numeric policy rollback): the state is the one "
                        "before it and its batch is not trained on", step)
        return action == "alerted"

    def _detail(self, event: NumericEvent, value, previous: NumericEvent | None) -> str:
        """``value``: this rank's loss, the mean of the loss tensor (a tensor, or the float read a step late)."""
        own = []
        if value is not None:
            own.append(f"loss {float(value):g}")
        if self._norms:
            own.append(f"gradient norm {self.grad_norm():g}")
        seen = f"this rank saw {', '.join(own) or 'no loss and no gradients'}"
        if previous is not None:
            return (f"{seen}; non-finite again {event.step - previous.step} steps after step {previous.step} was "
                    f"rolled back (within {self._recur_window}): the state or the machine is at fault, not one batch; "
                    "stopping rather than skip batch after batch")
        if self.policy == "stop":
            return f"{seen}; stopping (numeric policy stop)"
        if self.policy == "alert":
            return f"{seen}; the update applies (numeric policy alert): the weights may be NaN from here on"
        return f"{seen}; every rank skips the update (numeric policy rollback)"

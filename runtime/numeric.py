"""The numeric guard: a non-finite loss or gradient never reaches the model's weights unnoticed.

    guard = NumericGuard(rt)                       # the policy from TRAINWARDEN_NUMERIC_POLICY (trainwarden run)
    for step in ...:
        loss = forward_backward(...)               # gradients in .grad
        if guard.check(step, loss=local_loss, parameters=model.parameters()):
            optimizer.step()                       # False: the step's update is skipped (rolled back)

``check`` runs between the backward pass and the optimizer step, on every rank, every step. Each rank looks at
its own loss (before any reduction across ranks: the rank that computed it is the one to name) and the total
norm of its own gradients (the local shards of DTensors), and the ranks agree through one ``all_reduce`` (MIN)
of three integers: the lowest rank whose loss was not finite, the lowest whose gradients were not, and whether
every rank's gradients were not (negated: 0 when none was finite). Every rank then takes the same decision, so no collective is left half-done. A rank whose own loss was
not finite is the one named; when no loss was but every rank's gradients are (a data-parallel all-reduce in the
backward pass spreads one rank's NaN to all), the event says so rather than blame rank 0.

What a non-finite value leads to (``NUMERIC_POLICIES``, from ``--numeric-policy``):

``rollback`` (default)  the update is skipped on every rank. Because the check comes before the optimizer step,
    the state before the step is still in place (model, optimizer moments, step counter): going back to it is
    free, with no snapshot to read. The step's batch is not trained on; training goes on with the next step.
    No NaN can reach a checkpoint. A non-finite value again within ``RECUR_WINDOW`` steps of a rollback
    means the state or the machine is at fault, not a batch: the job stops (``NumericStop``) with both events
    as evidence, rather than skip batch after batch.
``stop``    ``NumericStop`` at once.
``alert``   the incident only; the update applies (the weights may become NaN).

The rank named first (its own loss, else its gradients, was not finite) reports a ``Numeric`` record to the
agent: one ``numeric`` incident per event, counted in ``trainwarden_numeric_events_total``. ``NumericStop``
is for the training script to let out of its loop; the reference job exits with ``EXIT_NUMERIC_STOP``, which
the launcher does not restart.

Cost: a norm of the rank's gradients (``torch._foreach_norm`` over them, in place on their device) and one
collective of three integers per step; ``tests/bench/bench_numeric.py`` measures it against the same loop
without the guard.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
import torch.distributed as dist

from trainwarden.agent.proto.contract import NUMERIC_POLICIES, NUMERIC_POLICY_ENV

__all__ = ["NumericEvent", "NumericGuard", "NumericStop", "RECUR_WINDOW", "policy_from_env"]

log = logging.getLogger(__name__)

RECUR_WINDOW = 10
"""A non-finite value within this many steps after a rollback stops the job instead of rolling back again."""


@dataclass(frozen=True)
class NumericEvent:
    """One step whose values were not finite, as every rank agreed."""

    step: int
    first_rank: int
    """The lowest rank whose own loss was not finite, else the lowest whose gradients were not."""
    where: str
    """"loss" or "gradients": what was not finite on ``first_rank``."""
    action: str
    """"rolled_back", "stopped" or "alerted"."""
    everywhere: bool = False
    """The gradients were not finite on every rank of the group (no rank's loss was): where it arose is unknown."""

    def describe(self) -> str:
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
    """

    def __init__(self, session=None, *, policy: str | None = None, group=None, device: torch.device | None = None,
                 recur_window: int = RECUR_WINDOW) -> None:
        self.policy = policy_from_env() if policy is None else policy
        if self.policy not in NUMERIC_POLICIES:
            raise ValueError(f"numeric policy {self.policy!r}: expected one of {', '.join(NUMERIC_POLICIES)}")
        self._session = session
        self._group = group
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._world = dist.get_world_size(group) if dist.is_initialized() else 1
        self._device = device
        self._recur_window = recur_window
        self.events: list[NumericEvent] = []
        self._norms: list[torch.Tensor] = []
        self._answers: tuple[torch.Tensor, torch.Tensor] | None = None  # the flags when finite, when not

    @property
    def rolled_back(self) -> int:
        return sum(1 for e in self.events if e.action == "rolled_back")

    def grad_norm(self) -> float:
        """This rank's own gradient norm at the last check (reads the device: not on the hot path)."""
        return float(torch.linalg.vector_norm(torch.stack(self._norms))) if self._norms else 0.0

    def _flags(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._answers is None or self._answers[0].device != device:
            finite = torch.tensor([self._world, self._world, 0], dtype=torch.int64, device=device)
            not_finite = torch.tensor([self._rank, self._rank, -1], dtype=torch.int64, device=device)
            self._answers = (finite, not_finite)
        return self._answers

    def check(self, step: int, *, loss: torch.Tensor | None, parameters: Iterable[torch.nn.Parameter]) -> bool:
        """True: apply the step's update. False: skip it (``rollback``). Raises ``NumericStop``. Collective: every
        rank of the group calls it at every step."""
        grads = [_local(p.grad) for p in parameters if p.grad is not None]
        device = self._device or (grads[0].device if grads else loss.device if loss is not None else torch.device("cpu"))
        if grads:  # a norm per tensor, in place on its device; any NaN or Inf element makes its norm so
            self._norms = torch._foreach_norm(grads)
            grad_ok = torch.isfinite(torch.stack(self._norms)).all()
        else:
            self._norms, grad_ok = [], torch.ones((), dtype=torch.bool, device=device)
        loss_ok = torch.isfinite(loss.detach()).all().to(device) if loss is not None else torch.ones(
            (), dtype=torch.bool, device=device)
        finite, not_finite = self._flags(device)
        flags = torch.where(torch.stack([loss_ok, grad_ok, grad_ok]), finite, not_finite)
        if self._world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self._group)
        first_loss, first_grad, none_finite = (int(v) for v in flags.tolist())
        if first_loss >= self._world and first_grad >= self._world:
            return True
        if first_loss < self._world:
            return self._act(step, first_loss, "loss", loss)
        everywhere = self._world > 1 and none_finite == 0
        return self._act(step, first_grad, "gradients", loss, everywhere=everywhere)

    def _act(self, step: int, first: int, where: str, loss: torch.Tensor | None, *, everywhere: bool = False) -> bool:
        previous = next((e for e in reversed(self.events) if e.action == "rolled_back"), None)
        recurred = previous is not None and step - previous.step <= self._recur_window
        action = {"rollback": "stopped" if recurred else "rolled_back", "stop": "stopped", "alert": "alerted"}[
            self.policy]
        event = NumericEvent(step=step, first_rank=first, where=where, action=action, everywhere=everywhere)
        self.events.append(event)
        detail = self._detail(event, loss, previous if recurred else None)
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

    def _detail(self, event: NumericEvent, loss: torch.Tensor | None, previous: NumericEvent | None) -> str:
        own = []
        if loss is not None:
            own.append(f"loss {float(loss.detach().float().mean()):g}")
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


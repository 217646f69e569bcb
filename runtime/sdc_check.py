"""Silent data corruption: data-parallel replicas recompute one micro-batch's gradient and compare it bitwise.

A node that computes wrong without crashing (a bad core, a marginal GPU) leaves finite values the numeric guard
cannot tell from good ones. Data-parallel replicas hold the same weights, so the same micro-batch's gradient
must come out bit for bit the same on each of them, given deterministic kernels (CPU and gloo here; on a GPU,
``torch.use_deterministic_algorithms`` and the same build). Every ``every`` steps, every rank of the group:

1. takes one micro-batch, the same on every rank (the reference job broadcasts one replica's, rotating which);
2. computes its gradient (``compute``: for the reference job a plain replica of the model, or in a pipeline of
   the rank's stage, with the full weights, ``ReplicaProbe``) and a 64-bit digest of its bytes (XXH3);
3. gathers every rank's digest (one ``all_gather`` of an integer per rank) and decides, the same on every rank:
   all equal, nothing; a strict majority, every rank outside it computed wrong; no majority (two replicas that
   disagree), every rank computes once more and a rank whose second result differs from its first computed
   wrong once (a transient fault: its second result agrees with the others). Two replicas that each repeat
   their own result cannot be told apart: both are reported, as unresolved (a third replica would decide).

A rank found wrong reports a ``numeric`` event of kind ``sdc`` itself, so the incident is recorded by its own
node's agent and names that node; ``trainwarden_numeric_events_total{kind="sdc"}`` counts it. The update of the
step applies (the recompute is a check, not the training step's gradient): the incident is the alert, and the
node is what to take out.

Cost per check: gathering the weights (an all-gather of the model), one forward and backward of one micro-batch
on the full model, hashing the gradient (XXH3 at ~10 GB/s) and one small all-gather; ``SdcCheck.seconds`` sums
it, and the reference job logs it. It is paid every ``every`` steps, so its share of the run is that over
``every`` steps' time.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import xxhash

__all__ = ["ReplicaProbe", "SdcCheck", "SdcEvent", "digest"]

log = logging.getLogger(__name__)


def digest(tensors: Sequence[torch.Tensor]) -> int:
    """XXH3-64 of the tensors' bytes in order, as a signed 64-bit integer (what an int64 tensor holds)."""
    h = xxhash.xxh3_64()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy())
    value = h.intdigest()
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass(frozen=True)
class SdcEvent:
    """One check whose replicas disagreed, as every rank of the group decided."""

    step: int
    ranks: tuple[int, ...]
    """Global ranks that computed wrong (``resolved``), or every rank that disagreed (not ``resolved``)."""
    resolved: bool
    detail: str


class SdcCheck:
    """Compares one micro-batch's gradient across the ranks of ``group`` every ``every`` steps (module docstring).

    ``session``: the ``trainwarden.runtime`` session a wrong rank reports through (None: logged only).
    ``gather``: one int per rank of the group in, all of them out (default: ``dist.all_gather``; tests inject it).
    """

    def __init__(self, session=None, *, every: int, group=None, gather: Callable[[list[int]], list[list[int]]] | None
                 = None, ranks: Sequence[int] | None = None, rank: int | None = None) -> None:
        if every < 1:
            raise ValueError(f"silent-corruption check: every must be >= 1 step, got {every}")
        self.every = every
        self._session = session
        self._group = group
        self._gather = gather or self._all_gather
        self._ranks = tuple(ranks) if ranks is not None else tuple(
            dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))
        self._rank = rank if rank is not None else dist.get_rank()
        self._me = self._ranks.index(self._rank)
        self.events: list[SdcEvent] = []
        self.checks = 0
        self.seconds = 0.0
        """Time spent in checks, this rank's (the cost: module docstring)."""

    @property
    def replicas(self) -> int:
        return len(self._ranks)

    def due(self, step: int) -> bool:
        """Whether ``step`` is a check step (every rank agrees: a pure function of the step)."""
        return self.replicas > 1 and step % self.every == 0

    def owner(self, step: int) -> int:
        """The index in the group of the replica whose micro-batch is probed at ``step`` (rotating)."""
        return (step // self.every) % self.replicas

    def check(self, step: int, compute: Callable[[], Sequence[torch.Tensor]]) -> SdcEvent | None:
        """Collective over the group: compute the gradient, compare, report. ``compute`` returns the gradient
        tensors of the shared micro-batch; it may be called twice (the recompute of a tie)."""
        began = time.perf_counter()
        try:
            first = digest(compute())
            seen = [row[0] for row in self._gather([first])]
            if len(set(seen)) == 1:
                return None
            value, count = Counter(seen).most_common(1)[0]
            if count * 2 > len(seen):
                wrong = tuple(self._ranks[i] for i, d in enumerate(seen) if d != value)
                event = SdcEvent(step, wrong, True, f"{count} of {len(seen)} replicas agree")
            else:  # no majority: recompute, a transient fault does not repeat
                second = digest(compute())
                rows = self._gather([first, second])
                wrong = tuple(self._ranks[i] for i, (a, b) in enumerate(rows) if a != b)
                if wrong:
                    event = SdcEvent(step, wrong, True, "its recompute differed from its first result, and agreed "
                                     "with the other replicas")
                else:
                    event = SdcEvent(step, tuple(self._ranks[i] for i in range(len(rows))), False,
                                     "each replica repeated its own result: which computes wrong cannot be told "
                                     "without a third replica")
            self.events.append(event)
            self._report(event, step)
            return event
        finally:
            self.checks += 1
            self.seconds += time.perf_counter() - began

    def _report(self, event: SdcEvent, step: int) -> None:
        names = ", ".join(str(r) for r in event.ranks)
        if self._rank not in event.ranks:
            log.warning("rank %d: silent-corruption check at step %d: rank(s) %s computed a different gradient of "
                        "the same micro-batch (%s)", self._rank, step, names, event.detail)
            return
        detail = (f"rank {self._rank} on node {socket.gethostname()} computed a gradient of step {step}'s probe "
                  f"micro-batch that differs bitwise from its replicas' ({event.detail})"
                  if event.resolved else
                  f"ranks {names} disagree bitwise on the gradient of step {step}'s probe micro-batch "
                  f"({event.detail}); this is rank {self._rank} on node {socket.gethostname()}")
        log.error("rank %d: silent data corruption: %s", self._rank, detail)
        if self._session is not None:
            self._session.numeric_event("sdc", step, first_rank=self._rank if event.resolved else -1,
                                        action="alerted", detail=detail)

    def _all_gather(self, values: list[int]) -> list[list[int]]:
        mine = torch.tensor(values, dtype=torch.int64)
        if dist.get_backend(self._group) == "nccl":
            mine = mine.cuda()
        out = [torch.empty_like(mine) for _ in self._ranks]
        dist.all_gather(out, mine, group=self._group)
        return [t.tolist() for t in out]


class ReplicaProbe:
    """The gradient of one micro-batch on a plain replica of a (sharded) model: the reference job's ``compute``.

    ``model``: the training model (FSDP2 and tensor-parallel DTensors or plain parameters); ``replica``: a plain
    module of the same structure and parameter names (built once: a full copy of the weights' memory);
    ``loss``: ``loss(replica(inputs), targets)``. ``load`` gathers the current weights into the replica
    (collective: ``full_tensor`` on every DTensor, in the same order on every rank), then ``gradients``
    computes, without touching the training model's ``.grad``.
    """

    def __init__(self, model: torch.nn.Module, replica: torch.nn.Module,
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        mine = dict(replica.named_parameters())
        names = [name for name, _ in model.named_parameters()]
        missing = [n for n in names if n not in mine]
        if missing or len(names) != len(mine):
            raise ValueError(f"the replica's parameters differ from the model's: missing {missing[:5]}, "
                             f"{len(mine)} against {len(names)}; build it from the same configuration")
        self._pairs = [(p, mine[n]) for n, p in model.named_parameters()]
        self._replica, self._loss = replica, loss

    def load(self) -> None:
        with torch.no_grad():
            for source, target in self._pairs:
                full = source.full_tensor() if hasattr(source, "full_tensor") else source
                target.copy_(full)

    def gradients(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        params = [target for _, target in self._pairs]
        loss = self._loss(self._replica(inputs), targets)
        return list(torch.autograd.grad(loss, params))

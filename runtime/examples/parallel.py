"""3-D parallelism for the reference transformer: pipeline × data (FSDP2) × tensor parallel.

The world is laid out as a ``DeviceMesh`` with dimensions ``("pp", "dp", "tp")`` (outermost first, so
tensor-parallel peers are adjacent ranks, then data-parallel replicas, then pipeline stages). Each rank

1. builds the whole model with the shared seed and cuts out its pipeline stage
   (:func:`trainwarden.runtime.examples.model.split_for_stage`): one stage per ``pp`` rank;
2. shards attention ``wq/wk/wv`` column-wise and ``wo`` row-wise, MLP ``w1`` column-wise and ``w2``
   row-wise over the ``tp`` mesh (Megatron style: one all-reduce after attention and one after the MLP;
   heads are split across tp ranks, so ``heads`` must be divisible by ``tp``);
3. shards every block, then the whole stage, with FSDP2 ``fully_shard`` over the ``dp`` mesh (tensor
   parallel parameters become 2-D DTensors: sharded on dp and tp);
4. wraps the stage in ``torch.distributed.pipelining.PipelineStage`` and drives it with ``Schedule1F1B``
   over ``micro_batches`` micro-batches, the loss computed on the last stage. Given the micro-batch size,
   each stage is told the shapes it receives and sends (:func:`stage_shapes`), so the first step does not
   infer them by running a forward and trading them stage to stage: a restarted job trains again ~0.1 s
   sooner (BENCHMARKS.md, issue 26).

A degree of 1 skips its layer entirely (no pipeline schedule for ``pp == 1``, no FSDP for ``dp == 1``, no
tensor parallelism for ``tp == 1``); parameter names are the same in every layout, so a checkpoint from one
layout loads into another and DCP reshards it.

The same code runs on CPU with gloo and on CUDA with NCCL (:func:`pick_device`, :func:`backend_for`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from trainwarden.runtime.examples.model import ModelConfig, Transformer, build_model, split_for_stage

__all__ = ["MeshConfig", "MeshError", "ParallelModel", "pick_device", "backend_for", "build_mesh",
           "apply_tensor_parallel", "apply_fsdp", "lm_loss", "stage_shapes", "build_parallel_model"]


class MeshError(ValueError):
    """The parallel layout does not fit the world or the model; fix the flags (not retryable)."""


@dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Degrees of parallelism; their product is the world size."""

    dp: int = 1
    """Data-parallel (FSDP2) degree."""
    tp: int = 1
    """Tensor-parallel degree; must divide the number of heads."""
    pp: int = 1
    """Pipeline-parallel degree: one stage per pp rank."""
    micro_batches: int = 2
    """Micro-batches per step on each data-parallel rank (the pipeline schedule's granularity)."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "micro_batches"):
            if getattr(self, name) < 1:
                raise MeshError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def check(self, *, world_size: int, model: ModelConfig, batch: int) -> None:
        """Raise :class:`MeshError` naming the problem if this layout cannot run ``model`` on ``world_size``."""
        if world_size != self.world_size:
            raise MeshError(f"world size {world_size} != dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = "
                            f"{self.world_size}; set --nproc-per-node x nnodes to {self.world_size} "
                            "or change --dp/--tp/--pp")
        if model.heads % self.tp:
            raise MeshError(f"--heads {model.heads} is not divisible by --tp {self.tp}")
        if model.layers < self.pp:
            raise MeshError(f"--layers {model.layers} is fewer than --pp {self.pp}; use at least one per stage")
        if self.pp > 1 and self.micro_batches < self.pp:
            raise MeshError(f"--micro-batches {self.micro_batches} is fewer than --pp {self.pp}; the 1F1B "
                            "schedule needs at least one micro-batch per stage")
        if batch % (self.dp * self.micro_batches):
            raise MeshError(f"global --batch {batch} is not divisible by --dp {self.dp} x --micro-batches "
                            f"{self.micro_batches}; choose a batch that is a multiple of "
                            f"{self.dp * self.micro_batches}")


def pick_device(local_rank: int) -> torch.device:
    """This rank's CUDA device if CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """Process-group backend for ``device``: NCCL for CUDA tensors (gloo for CPU ones), else gloo."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def build_mesh(cfg: MeshConfig, device: torch.device) -> DeviceMesh:
    """The ``("pp", "dp", "tp")`` mesh over the default process group."""
    return init_device_mesh(device.type, (cfg.pp, cfg.dp, cfg.tp), mesh_dim_names=("pp", "dp", "tp"))


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Shard attention and MLP projections of every block over ``tp_mesh`` (in place)."""
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan)


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, *, reshard_after_forward: bool) -> None:
    """FSDP2 over ``dp_mesh``: one unit per block plus the rest of the stage (in place)."""
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def stage_shapes(model: Transformer, micro_batch: int) -> dict[str, torch.Tensor]:
    """``PipelineStage``'s ``input_args`` and ``output_args`` for this stage of ``model``: meta tensors of what
    one micro-batch of ``micro_batch`` sequences looks like coming in (token ids on the first stage, hidden
    states after it) and going out (hidden states, logits from the last stage). Plain tensors: the tensor
    parallel layers hand back local outputs, so no DTensor crosses a stage boundary."""
    cfg = model.cfg
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    hidden = torch.empty((micro_batch, cfg.seq, cfg.dim), dtype=dtype, device="meta", requires_grad=True)
    tokens = torch.empty((micro_batch, cfg.seq), dtype=torch.long, device="meta")
    logits = torch.empty((micro_batch, cfg.seq, cfg.vocab), dtype=dtype, device="meta", requires_grad=True)
    return {"input_args": tokens if model.tok_embeddings is not None else hidden,
            "output_args": logits if model.output is not None else hidden}


class ParallelModel:
    """This rank's part of the 3-D parallel model and how to run one training step through it."""

    def __init__(self, model: Transformer, mesh: DeviceMesh, cfg: MeshConfig, device: torch.device, *,
                 micro_batch: int | None = None) -> None:
        """``micro_batch``: sequences per pipeline micro-batch, if every step's is the same: the stage is built
        with its shapes (:func:`stage_shapes`) instead of inferring them on the first step. None: inferred."""
        self.model = model
        self.mesh = mesh
        self.cfg = cfg
        self.device = device
        self.pp_rank = mesh["pp"].get_local_rank()
        self.dp_rank = mesh["dp"].get_local_rank()
        self.tp_rank = mesh["tp"].get_local_rank()
        self.is_first_stage = self.pp_rank == 0
        self.is_last_stage = self.pp_rank == cfg.pp - 1
        self._schedule = None
        self.accumulate = 1
        """Without a pipeline: micro-batches this rank's slice is split into, their gradients accumulated."""
        self.micro_batch = micro_batch if cfg.pp > 1 else None
        self.local_loss: torch.Tensor | None = None
        """This rank's own loss of the last step, before the mean over data-parallel ranks (last stage only): the
        numeric guard names the rank whose own loss was not finite (runtime/numeric.py)."""
        self._poison: float | None = None
        if cfg.pp > 1:
            shapes = stage_shapes(model, micro_batch) if micro_batch else {}
            stage = PipelineStage(model, self.pp_rank, cfg.pp, device, group=mesh["pp"].get_group(), **shapes)
            self._schedule = Schedule1F1B(stage, n_microbatches=cfg.micro_batches, loss_fn=self._loss)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(logits, targets)
        return loss if self._poison is None else loss * self._poison

    @property
    def is_reporter(self) -> bool:
        """True on the one rank that prints progress: first dp and tp rank of the last stage."""
        return self.is_last_stage and self.dp_rank == 0 and self.tp_rank == 0

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, *,
                   poison: float | None = None) -> torch.Tensor | None:
        """Forward and backward for this rank's data slice; gradients are left in ``.grad``.

        Returns the loss averaged over the global batch (all data-parallel ranks) on last-stage ranks,
        ``None`` elsewhere. The optimizer step is the caller's. ``poison`` (the ``nan`` and ``spike`` faults): this
        rank's loss is multiplied by it, or on a stage before the last, which computes none, its gradients are.
        """
        self._poison = poison
        try:
            loss = self._forward_backward(inputs, targets)
        finally:
            self._poison = None
        self.local_loss = loss
        if poison is not None and loss is None:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            torch._foreach_mul_([getattr(g, "to_local", lambda g=g: g)() for g in grads], poison)
        if loss is not None and self.cfg.dp > 1:
            loss = loss.clone()
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self.mesh["dp"].get_group())
            loss = loss / self.cfg.dp
        return loss

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        if self.micro_batch and len(inputs) != self.micro_batch * self.cfg.micro_batches:
            raise ValueError(f"this rank's batch has {len(inputs)} sequences, but its pipeline stage was built for "
                             f"{self.cfg.micro_batches} micro-batches of {self.micro_batch}; build the model with "
                             "micro_batch=None to let the stages infer their shapes from each step")
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        if self._schedule is None and self.accumulate > 1:  # each part weighted by its share of the slice
            loss = torch.zeros((), device=self.device)
            for part_in, part_t in zip(inputs.chunk(self.accumulate), targets.chunk(self.accumulate)):
                part = self._loss(self.model(part_in), part_t) * (len(part_in) / len(inputs))
                part.backward()
                loss += part.detach()
        elif self._schedule is None:
            loss = self._loss(self.model(inputs), targets)
            loss.backward()
            loss = loss.detach()
        else:
            losses: list[torch.Tensor] = []
            if self.is_first_stage:
                self._schedule.step(inputs)
            elif self.is_last_stage:
                self._schedule.step(target=targets, losses=losses, return_outputs=False)
            else:
                self._schedule.step()
            if not self.is_last_stage:
                return None
            loss = torch.stack([part.detach() for part in losses]).mean()
        return loss


def build_parallel_model(model_cfg: ModelConfig, mesh_cfg: MeshConfig, mesh: DeviceMesh,
                         device: torch.device, *, seed: int, micro_batch: int | None = None) -> ParallelModel:
    """Build the full model from ``seed``, keep this rank's stage, apply TP and FSDP, move to ``device``.
    ``micro_batch``: sequences per pipeline micro-batch when it never changes (see :class:`ParallelModel`)."""
    pp_rank = mesh["pp"].get_local_rank()
    model = split_for_stage(build_model(model_cfg, seed=seed), pp_rank, mesh_cfg.pp)
    model.to(device)
    if mesh_cfg.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    if mesh_cfg.dp > 1:
        # with a pipeline, every micro-batch's backward needs the parameters again: keep them gathered
        apply_fsdp(model, mesh["dp"], reshard_after_forward=mesh_cfg.pp == 1)
    return ParallelModel(model, mesh, mesh_cfg, device, micro_batch=micro_batch)

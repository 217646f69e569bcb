"""The reference GPT's command line: ``TrainConfig`` (everything one run needs), its flags and their checks
(``parse_args``). Split from gpt.py, which trains with it."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Sequence

from trainwarden.agent.shared.contract import CHECKPOINT_DIR_ENV, NUMERIC_POLICIES
from trainwarden.runtime.examples.model import ModelConfig
from trainwarden.runtime.examples.parallel import MeshConfig
from trainwarden.runtime.numeric import policy_from_env

__all__ = ["TrainConfig", "parse_args"]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything one run needs, from the command line."""

    model: ModelConfig
    """Transformer shape."""
    mesh: MeshConfig
    """Parallel layout."""
    batch: int
    """Global batch size (sequences per step over all data-parallel ranks)."""
    steps: int
    """Train until this step number (inclusive); a resumed run continues up to it."""
    lr: float
    """Peak AdamW learning rate."""
    warmup: int
    """Linear warm-up steps; the learning rate is a pure function of the step."""
    seed: int
    """Seed for the initial weights and the data."""
    ckpt_dir: str | None
    """Checkpoint directory; None disables checkpointing and resuming."""
    ckpt_every: int
    """Save after every step divisible by this."""
    keep: int
    """Complete checkpoints kept."""
    log_every: int
    """Log every this many steps (and always the last)."""
    snapshot_every: int = 1
    """Snapshot the state into the node agent's memory after every step divisible by this (0: never); a restart
    after a fault resumes from the newest snapshot when it is newer than the disk's checkpoint."""
    allow_fresh_start: bool = False
    """Train from step 1 even when checkpoints exist but none loads (otherwise the run stops and says so)."""
    infer_pipeline_shapes: bool = False
    """Let the pipeline stages infer what they send and receive on the first step (torch's default) instead of
    being built with the micro-batch's shapes."""
    numeric_policy: str = "rollback"
    """What a step whose loss or gradients are not finite leads to (runtime/numeric.py): ``rollback`` skips its
    update on every rank, ``stop`` ends the run (EXIT_NUMERIC_STOP), ``alert`` only reports it."""
    sdc_every: int = 0
    """Every this many steps the data-parallel replicas recompute one micro-batch's gradient and compare it bitwise
    (runtime/sdc_check.py: silent data corruption; 0: never; in a pipeline each stage on its own). Needs --dp 2 or
    more."""
    step_pad_s: float = 0.0
    """Seconds every step sleeps, inside the step, before its work: a stand-in for accelerator compute on a CPU-only
    machine, so a soak's steps take the time its fault plan assumes (tests/bench/soak.py ``--pad-s``). Numerics
    are unchanged."""
    micro_batch_size: int = 0
    """Sequences per micro-batch on a data-parallel rank (0: ``mesh.micro_batches`` fixed instead). Fixed, the
    micro-batch count follows the world: when data parallelism shrinks after a node loss, each rank takes
    more micro-batches of the same size (gradient accumulation without a pipeline), so the global batch and
    the memory a micro-batch needs both stay as they were."""

    def __post_init__(self) -> None:
        for name in ("batch", "steps", "ckpt_every", "keep", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.snapshot_every < 0:
            raise ValueError(f"--snapshot-every must be >= 0, got {self.snapshot_every}")
        if self.sdc_every < 0:
            raise ValueError(f"--sdc-every must be >= 0, got {self.sdc_every}")
        if self.warmup < 0 or not self.lr > 0:
            raise ValueError(f"need --lr > 0 and --warmup >= 0, got lr={self.lr} warmup={self.warmup}")
        if not 0 <= self.step_pad_s < 3600:
            raise ValueError(f"--step-pad-s must be 0 or more seconds (under an hour), got {self.step_pad_s}")

    def lr_at(self, step: int) -> float:
        return self.lr * min(1.0, step / self.warmup) if self.warmup else self.lr


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainwarden.runtime.examples.gpt",
                                description="3-D parallel GPT on synthetic data (run under torchrun)")
    add = p.add_argument
    add("--dp", type=int, default=None, help="data-parallel (FSDP2) degree (default: world size / (tp x pp), "
        "so a job that lost or gained nodes resumes with the data parallelism that fits)")
    add("--tp", type=int, default=1, help="tensor-parallel degree (divides --heads)")
    add("--pp", type=int, default=1, help="pipeline stages (<= --layers)")
    add("--layers", type=int, default=4)
    add("--dim", type=int, default=64)
    add("--heads", type=int, default=4)
    add("--seq", type=int, default=64, help="tokens per sequence")
    add("--vocab", type=int, default=256)
    add("--micro-batches", type=int, default=2, help="pipeline micro-batches per dp rank and step")
    add("--batch", type=int, default=8, help="global batch size, a multiple of dp x micro-batches")
    add("--micro-batch-size", type=int, default=0, metavar="N",
        help="sequences per micro-batch on each dp rank: the micro-batch count becomes batch / (dp x N), and "
             "without a pipeline the rank accumulates gradients over them; the global batch and the memory per "
             "micro-batch stay the same when the world changes (default: --micro-batches fixed)")
    add("--steps", type=int, default=20, help="last step to run (steps count from 1)")
    add("--lr", type=float, default=3e-3)
    add("--warmup", type=int, default=3, help="linear learning-rate warm-up steps")
    add("--seed", type=int, default=0)
    add("--ckpt-dir", default=os.environ.get(CHECKPOINT_DIR_ENV) or None,
        help="checkpoint directory; resumes from its newest complete checkpoint "
             "(default: $TRAINWARDEN_CHECKPOINT_DIR, which `trainwarden run` sets; none: no checkpoints)")
    add("--ckpt-every", type=int, default=10, help="save after every N-th step")
    add("--keep", type=int, default=3, help="complete checkpoints to keep")
    add("--snapshot-every", type=int, default=1, metavar="N",
        help="snapshot the state into the node agent's shared memory after every N-th step (default 1; 0: never): "
             "a restart after a crash or a hang resumes from the step before it, from memory. Only under "
             "`trainwarden run` (it owns the memory)")
    add("--log-every", type=int, default=1)
    add("--infer-pipeline-shapes", action="store_true",
        help="let the pipeline stages infer their input and output shapes on the first step, as torch does "
             "by default (default: built with the micro-batch's shapes, which saves that step ~0.1 s here)")
    add("--numeric-policy", choices=list(NUMERIC_POLICIES), default=None,
        help="a step whose loss or gradients are not finite: rollback (skip its update on every rank and train on), "
             "stop, or alert (default: $TRAINWARDEN_NUMERIC_POLICY, which `trainwarden run --numeric-policy` sets; "
             "else rollback)")
    add("--sdc-every", type=int, default=0, metavar="N",
        help="every N steps, the data-parallel replicas recompute one micro-batch's gradient and compare it "
             "bitwise (in a pipeline, each stage on its own); a rank that computes wrong is a numeric incident (kind "
             "sdc) naming its node (default 0: never)")
    add("--step-pad-s", type=float, default=0.0, metavar="S",
        help="sleep S seconds inside every step, a stand-in for accelerator compute on a CPU-only machine "
             "(default 0: none; the losses are the same either way)")
    add("--allow-fresh-start", action="store_true",
        help="start from step 1 when checkpoints exist but none can be loaded (default: stop and say why)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """Parse flags into a validated :class:`TrainConfig` (``ValueError`` subclasses on bad values)."""
    a = _parser().parse_args(argv)
    dp = a.dp if a.dp is not None else _fitting_dp(a.tp, a.pp)
    micro_batches = a.micro_batches
    if a.micro_batch_size:
        if a.micro_batch_size < 0 or a.batch % dp or (a.batch // dp) % a.micro_batch_size:
            raise ValueError(f"--micro-batch-size {a.micro_batch_size} must be positive and divide each dp rank's "
                             f"share of --batch {a.batch} (dp {dp}: {a.batch / dp:g} sequences)")
        micro_batches = a.batch // dp // a.micro_batch_size
    return TrainConfig(
        model=ModelConfig(vocab=a.vocab, dim=a.dim, heads=a.heads, layers=a.layers, seq=a.seq),
        mesh=MeshConfig(dp=dp, tp=a.tp, pp=a.pp, micro_batches=micro_batches),
        micro_batch_size=a.micro_batch_size,
        batch=a.batch, steps=a.steps, lr=a.lr, warmup=a.warmup, seed=a.seed, ckpt_dir=a.ckpt_dir,
        ckpt_every=a.ckpt_every, keep=a.keep, log_every=a.log_every, allow_fresh_start=a.allow_fresh_start,
        snapshot_every=a.snapshot_every, infer_pipeline_shapes=a.infer_pipeline_shapes, sdc_every=a.sdc_every,
        numeric_policy=a.numeric_policy or policy_from_env(), step_pad_s=a.step_pad_s)


def _fitting_dp(tp: int, pp: int) -> int:
    """The data-parallel degree that fills the world torchrun gave this round (MeshConfig.check says what is
    wrong when tp x pp does not divide it)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return max(1, world // max(1, tp * pp))

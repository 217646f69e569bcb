"""A small decoder-only transformer language model, built so that it can be cut into pipeline stages.

The model is the reference workload's: token embedding, ``layers`` pre-norm blocks (causal self-attention
and a GELU MLP, each behind an RMSNorm and a residual), a final norm and an output projection.

Two properties matter more than the architecture:

* **Stage-independent parameter names.** Blocks live in an ``nn.ModuleDict`` keyed ``"0".."N-1"``. A
  pipeline stage is made by building the *whole* model and deleting what the stage does not own
  (:func:`split_for_stage`, torchtitan's approach): the first stage keeps ``tok_embeddings``, the last keeps
  ``norm`` and ``output``, and a stage holding block 5 calls it ``layers.5.*`` just as the unsplit model does.
  Checkpoints are keyed by these fully-qualified names, so they load into any pipeline layout.
* **Mesh-independent initialisation.** :func:`build_model` seeds a private generator and initialises every
  parameter of the full model in a fixed order before any split, so each rank of any mesh starts from the
  same weights for the same seed.

Every missing part is ``None`` and ``forward`` skips it: a middle stage maps hidden states to hidden
states, the first maps token ids to hidden states, the last hidden states to logits.

Attention infers its head count from the projection width (``view(b, s, -1, head_dim)``), so after tensor
parallelism shards ``wq/wk/wv`` column-wise each rank simply runs its share of the heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelConfig", "ModelConfigError", "Attention", "FeedForward", "Block", "Transformer",
           "build_model", "split_for_stage", "stage_layer_ids"]


class ModelConfigError(ValueError):
    """The model configuration is inconsistent; fix the flags (not retryable)."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the transformer."""

    vocab: int = 256
    """Vocabulary size (token ids are in ``[0, vocab)``)."""
    dim: int = 64
    """Model (residual stream) width."""
    heads: int = 4
    """Attention heads; must divide ``dim``."""
    layers: int = 4
    """Number of transformer blocks."""
    seq: int = 64
    """Maximum sequence length (size of the learned position table)."""
    mlp_ratio: int = 4
    """MLP hidden width as a multiple of ``dim``."""

    def __post_init__(self) -> None:
        for name in ("vocab", "dim", "heads", "layers", "seq", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ModelConfigError(f"model {name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise ModelConfigError(f"--dim {self.dim} is not divisible by --heads {self.heads}; "
                                   "choose dim as a multiple of heads")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def matmul_params(self) -> int:
        """Parameters in the model's matrix multiplies (attention, MLP, output; not the embedding tables or
        norms): the N of the 6·N FLOPs per token an MFU counts (`trainwarden run --model-params N`)."""
        return self.layers * (4 + 2 * self.mlp_ratio) * self.dim * self.dim + self.dim * self.vocab


class Attention(nn.Module):
    """Causal multi-head self-attention; heads are inferred from the (possibly sharded) projection width."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # (b, s, local_heads, head_dim) -> (b, local_heads, s, head_dim)
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """Two-layer GELU MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.dim * cfg.mlp_ratio, bias=False)
        self.w2 = nn.Linear(cfg.dim * cfg.mlp_ratio, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Decoder-only LM whose parts may be removed (set to ``None``) to form a pipeline stage."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos_embeddings: nn.Embedding | None = nn.Embedding(cfg.seq, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.dim)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids ``(b, s)`` or hidden states ``(b, s, dim)`` in; hidden states or logits out."""
        if self.tok_embeddings is not None:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.tok_embeddings(x) + self.pos_embeddings(positions)
        for block in self.layers.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.output is not None:
            x = self.output(x)
        return x

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Initialise every parameter in name order from ``generator`` (normal(0, 0.02), norms to one)."""
        for name, param in sorted(self.named_parameters()):
            if "norm" in name:
                param.fill_(1.0)
            else:
                std = 0.02
                if name.endswith(("wo.weight", "w2.weight")):
                    std = 0.02 / (2 * max(1, len(self.layers))) ** 0.5   # GPT-2 residual scaling
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * std)


def build_model(cfg: ModelConfig, *, seed: int) -> Transformer:
    """The full model on CPU, initialised deterministically from ``seed`` (identical on every rank)."""
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


def stage_layer_ids(num_layers: int, stage: int, num_stages: int) -> list[int]:
    """Block indices owned by ``stage``: contiguous, sizes differing by at most one (earlier stages larger)."""
    if not 0 <= stage < num_stages:
        raise ModelConfigError(f"stage {stage} out of range for {num_stages} stages")
    if num_layers < num_stages:
        raise ModelConfigError(f"--layers {num_layers} is fewer than --pp {num_stages} pipeline stages; "
                               "use at least one layer per stage")
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (1 if stage < extra else 0)))


def split_for_stage(model: Transformer, stage: int, num_stages: int) -> Transformer:
    """Delete, in place, every part ``stage`` of ``num_stages`` does not own; returns ``model``."""
    keep = {str(i) for i in stage_layer_ids(len(model.layers), stage, num_stages)}
    for key in list(model.layers.keys()):
        if key not in keep:
            del model.layers[key]
    if stage != 0:
        model.tok_embeddings = None
        model.pos_embeddings = None
    if stage != num_stages - 1:
        model.norm = None
        model.output = None
    return model

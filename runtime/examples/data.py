"""Deterministic synthetic language-model data whose position is the step number.

Sample ``j`` of the global batch at step ``s`` is a pure function of ``(seed, s, j)``: a private
``torch.Generator`` is seeded from the three through a fixed integer mix (:func:`sample_seed`). Nothing
depends on the mesh, the rank or what ran before, so

* resuming at step ``s + 1`` replays exactly the data an uninterrupted run would have seen (the data
  "position" saved in a checkpoint is just the step), and
* a run with a different data-parallel degree sees the same global batch, only sliced differently.

Each data-parallel rank takes a contiguous slice of the global batch (:meth:`SyntheticData.batch`);
tensor-parallel peers ask for the same slice and so see the same tokens.

The sequences are learnable, so the loss visibly falls within a few dozen steps: each one repeats a short
motif whose tokens are drawn from a skewed (Zipf-like) distribution. A model first learns the skew
(unigram statistics, a quick drop from ``ln(vocab)``) and then to copy the motif from earlier in the
context (an induction pattern), which drives the loss lower.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DataConfig", "DataConfigError", "SyntheticData", "sample_seed"]

_MASK64 = (1 << 64) - 1


class DataConfigError(ValueError):
    """The data configuration does not fit the mesh; fix the flags (not retryable)."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Shape of the synthetic token stream."""

    vocab: int = 256
    """Token ids are in ``[0, vocab)``."""
    seq: int = 64
    """Tokens per training sequence (inputs; targets are the same sequence shifted by one)."""
    batch: int = 8
    """Global batch size: sequences per step summed over data-parallel ranks."""
    seed: int = 0
    """Seed shared by every rank."""
    min_motif: int = 3
    """Shortest repeated motif."""
    max_motif: int = 8
    """Longest repeated motif."""

    def __post_init__(self) -> None:
        if self.vocab < 2 or self.seq < 2 or self.batch < 1:
            raise DataConfigError(f"need vocab >= 2, seq >= 2, batch >= 1; got vocab={self.vocab} "
                                  f"seq={self.seq} batch={self.batch}")
        if not 1 <= self.min_motif <= self.max_motif:
            raise DataConfigError(f"need 1 <= min_motif <= max_motif, got {self.min_motif}, {self.max_motif}")


def sample_seed(seed: int, step: int, index: int) -> int:
    """A 63-bit generator seed mixing ``(seed, step, index)`` (splitmix64 finaliser per component)."""
    h = 0x9E3779B97F4A7C15
    for part in (seed, step, index):
        h = (h ^ (part & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 29
    return h >> 1


class SyntheticData:
    """Batches of ``(inputs, targets)`` for a step, sliced for one data-parallel rank."""

    def __init__(self, cfg: DataConfig) -> None:
        self.cfg = cfg
        ranks = torch.arange(1, cfg.vocab + 1, dtype=torch.float64)
        self._token_weights = 1.0 / ranks            # Zipf(1): token 0 is the most frequent

    def sample(self, step: int, index: int) -> torch.Tensor:
        """Sequence ``index`` of the global batch at ``step``: ``seq + 1`` int64 tokens."""
        gen = torch.Generator().manual_seed(sample_seed(self.cfg.seed, step, index))
        length = int(torch.randint(self.cfg.min_motif, self.cfg.max_motif + 1, (1,), generator=gen))
        motif = torch.multinomial(self._token_weights, length, replacement=True, generator=gen)
        reps = (self.cfg.seq + 1 + length - 1) // length
        return motif.repeat(reps)[: self.cfg.seq + 1]

    def batch(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each ``(batch // dp_size, seq)``, for ``dp_rank``'s slice of ``step``."""
        if self.cfg.batch % dp_size:
            raise DataConfigError(f"global --batch {self.cfg.batch} is not divisible by --dp {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise DataConfigError(f"dp rank {dp_rank} out of range for dp size {dp_size}")
        per_rank = self.cfg.batch // dp_size
        first = dp_rank * per_rank
        tokens = torch.stack([self.sample(step, first + i) for i in range(per_rank)])
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

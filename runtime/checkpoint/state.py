"""Stateful helpers for ``Checkpointer`` state: ``ModelState`` and per-rank ``RNGState`` with its sidecars.

``ModelState`` wraps a model and its optimizers through torch's distributed state-dict API, so FSDP2/DTensor
shards go to DCP as they are and DCP reshards them on load at another world size.

Each rank's generators differ (dropout masks, data shuffles seeded per rank), so their state cannot be a DCP
key: DCP deduplicates equal keys across ranks and fails to load keys a new world size does not have. The
``Checkpointer`` therefore takes ``RNGState`` entries out of the DCP state dict and writes them per rank as
``rng-rank<R>.pt`` inside the checkpoint directory (tmp + fsync + rename), before the rank enters DCP's
planning collective. On restore at the same world size each rank reads its own file and continues exactly;
at another world size the Checkpointer skips them with a warning.

Captured: torch's CPU generator, every CUDA device's generator when CUDA is available, Python's ``random``
and NumPy's global generator. Files are loaded with ``weights_only=True`` (tensors, ints, tuples only).
"""

from __future__ import annotations

import io
import logging
import random
from pathlib import Path
from collections.abc import MutableMapping
from typing import Any, Mapping

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful

from trainwarden.agent.shared.checkpoint_layout import atomic_write

__all__ = ["ModelState", "RNGState", "load_sidecar", "write_sidecar"]

logger = logging.getLogger(__name__)


class RNGState(Stateful):
    """The calling process's global generators, as a Stateful entry of a ``Checkpointer`` state dict."""

    def state_dict(self) -> dict[str, Any]:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state: dict[str, Any] = {
            "torch_cpu": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch_cpu"])
        version, internal, gauss = state_dict["python"]
        random.setstate((version, tuple(internal), gauss))
        n = state_dict["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
        cuda = state_dict.get("cuda")
        if cuda is not None and torch.cuda.is_available():
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)
            else:
                logger.warning("CUDA RNG state saved for %d devices, %d visible now: not restored", len(cuda),
                               torch.cuda.device_count())


def write_sidecar(path: Path, states: Mapping[str, dict]) -> None:
    """Atomically write ``{key: RNGState.state_dict()}`` to ``path``."""
    buffer = io.BytesIO()
    torch.save(dict(states), buffer)
    atomic_write(path, buffer.getvalue())


def load_sidecar(path: Path, entries: Mapping[str, RNGState]) -> bool:
    """Load ``path`` into the ``RNGState`` entries; False (logged) when it cannot be read — the run then
    continues with its current generators rather than failing."""
    try:
        saved = torch.load(path, weights_only=True)
        for key, entry in entries.items():
            if key not in saved:
                logger.warning("RNG sidecar %s has no entry %r (has %s): not restored", path, key, sorted(saved))
                continue
            entry.load_state_dict(saved[key])
    except Exception as exc:
        logger.warning("could not restore RNG state from %s (%s: %s); continuing with current generators",
                       path, type(exc).__name__, exc)
        return False
    return True


class ModelState(Stateful):
    """Model and optimizer(s) as one DCP Stateful, through torch's distributed state-dict API (works for
    FSDP2/DTensor-sharded and plain modules; DCP reshards on load). ``state_dict()`` is ``get_state_dict``'s
    result, the parameter names worked out once (runtime/checkpoint/state_dict_reader.py): a snapshot asks every step."""

    def __init__(self, model: torch.nn.Module, optimizers: torch.optim.Optimizer | list | None = None) -> None:
        self.model = model
        self.optimizers = optimizers if optimizers is not None else []
        self._reader = None

    def state_dict(self) -> dict[str, Any]:
        if self._reader is None:  # imported on first use, as get_state_dict was: it imports torch's FSDP modules
            from trainwarden.runtime.checkpoint.state_dict_reader import StateDictReader

            self._reader = StateDictReader(self.model, self.optimizers)
        model_sd, optim_sd = self._reader.read()
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizers, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def put_back(state: Mapping[str, Any], name: str, loaded: Any) -> None:
    """Give ``state[name]``, an entry that is not Stateful, the value a restore loaded for it, keeping the object
    the caller holds: a dict is updated and a list refilled in place, anything else (a number) is set in ``state``
    when it can be. DCP updates a dict entry in place itself but hands back a new list or number, and the memory
    snapshot's load builds new values; both restores use this, so a job's plain entries (an epoch, a data
    position) come back the same from either."""
    entry = state[name]
    if loaded is entry:
        return
    if isinstance(entry, MutableMapping) and isinstance(loaded, Mapping):
        entry.update(loaded)
    elif isinstance(entry, list) and isinstance(loaded, (list, tuple)):
        entry[:] = loaded
    elif isinstance(state, MutableMapping):
        state[name] = loaded


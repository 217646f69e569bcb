"""``get_state_dict`` for a job that asks every step: the names worked out once, the dicts built from them.

torch's ``get_state_dict`` finds every parameter's fully-qualified name by walking the module tree, for every key,
on every call. For the reference job (one pipeline stage of 4 layers, FSDP2 x TP) that walk is about half of a
2.4 ms call, and a memory snapshot after every step makes the call every step, on every rank.

``StateDictReader.read()`` returns what ``get_state_dict(model, optimizers, options=options)`` returns. Its first
call asks ``get_state_dict`` itself, then builds the same two dicts the short way (``model.state_dict()``,
each ``optimizer.state_dict()`` with its parameter numbers replaced by the names, flattened when the options say
so) and compares them, key by key, value by value (a tensor: its type, shape, dtype and storage). Only when they
agree does it keep the short way; otherwise it asks ``get_state_dict`` for good and says so once in the log.

The short way is taken only while what the names were worked out from is unchanged, checked on every call:
the model's state-dict keys, its parameter objects and each optimizer's. An optimizer with no state and no
gradients goes to ``get_state_dict`` too, which makes its state with a zero-lr step, unless that step was seen to
leave it without state (SGD without momentum). Anything else goes to
``get_state_dict`` and the comparison is made again. The keys of a model wrapped by DDP or ``torch.compile`` lose
the wrapper's ``module.`` or ``_orig_mod.`` as torch's names do. Options it does not serve (full or CPU-offloaded
state dicts, frozen parameters left out) and models whose keys are not their names in another way (FSDP1, an
activation-checkpoint wrapper: the comparison fails) always go to ``get_state_dict``. No private torch helper is
used: a torch whose format differs fails the comparison and gets the slow way, not a wrong one.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

__all__ = ["StateDictReader"]

logger = logging.getLogger(__name__)

_STATE, _PARAM_GROUPS, _PARAMS = "state", "param_groups", "params"


class StateDictReader:
    """``get_state_dict(model, optimizers, options=options)``, fast on every call after the first."""

    def __init__(self, model: torch.nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]
                 | None = None, *, options: StateDictOptions | None = None) -> None:
        self.model = model
        if optimizers is None:
            optimizers = ()
        self.optimizers = (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)
        self.options = options or StateDictOptions()
        self._served = not (self.options.full_state_dict or self.options.cpu_offload
                            or self.options.ignore_frozen_params)
        self._layout: _Layout | None = None
        self.fast_reads = 0  # for tests and benchmarks: how many reads took the short way

    def read(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's and the optimizers' state dicts, as ``get_state_dict`` gives them."""
        if self._layout is not None:
            fast = self._layout.read(self.model, self.optimizers, self.options)
            if fast is not None:
                self.fast_reads += 1
                return fast
            self._layout = None
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers, options=self.options)
        if self._served:
            self._learn(model_sd, optim_sd)
        return model_sd, optim_sd

    def _learn(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        layout = _Layout.of(self.model, self.optimizers)
        if layout is None:
            return self._give_up("a parameter is not named by the model's state dict")
        difference = _difference((model_sd, optim_sd), layout.read(self.model, self.optimizers, self.options))
        if difference is not None:  # keys that are not the names (FSDP1, a checkpoint wrapper), or another format
            return self._give_up(difference)
        self._layout = layout
        return None

    def _give_up(self, why: str) -> None:
        self._served = False
        logger.info("state dicts come from get_state_dict on every call (%s); nothing is wrong, it is slower", why)


class _Layout:
    """The model's state-dict keys and parameters, and each optimizer's parameters and their names, as learnt."""

    def __init__(self, keys: tuple[str, ...], renames: list[tuple[str, str]], params: list[torch.Tensor],
                 optim_params: list[list[torch.Tensor]], optim_names: list[list[str]], stateless: list[bool]) -> None:
        self.keys, self.renames, self.params = keys, renames, params
        self.optim_params, self.optim_names = optim_params, optim_names
        self.stateless = stateless
        """Per optimizer: get_state_dict's zero-lr step just ran and left it without state (SGD without momentum)."""

    @classmethod
    def of(cls, model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...]) -> _Layout | None:
        """Learnt right after a ``get_state_dict`` call; None when a parameter is not among the model's keys."""
        keys = tuple(model.state_dict().keys())
        named = list(model.named_parameters())
        if any(key not in keys for key, _ in named):
            return None
        renames = [(key, name) for key in keys if (name := _name(model, key)) != key]
        names = {id(p): _name(model, key) for key, p in named}
        optim_params = [list(itertools.chain.from_iterable(g[_PARAMS] for g in o.param_groups)) for o in optimizers]
        if any(id(p) not in names for params in optim_params for p in params):  # torch itself fails on these
            return None
        optim_names = [[names[id(p)] for p in params] for params in optim_params]
        stateless = [not o.state and not _has_grad(params) for o, params in zip(optimizers, optim_params)]
        return cls(keys, renames, [p for _, p in named], optim_params, optim_names, stateless)

    def read(self, model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...],
             options: StateDictOptions) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The two dicts the short way, or None when something they were learnt from has changed."""
        if not _same(self.params, (p for _, p in model.named_parameters())):
            return None
        for optimizer, params, stateless in zip(optimizers, self.optim_params, self.stateless):
            if not _same(params, itertools.chain.from_iterable(g[_PARAMS] for g in optimizer.param_groups)):
                return None
            if not optimizer.state and not stateless and not _has_grad(params):
                return None  # get_state_dict would make its state with a zero-lr step: let it
        model_sd = model.state_dict()
        if tuple(model_sd.keys()) != self.keys:
            return None
        for key, name in self.renames:  # in key order, to the end: the order get_state_dict leaves them in
            model_sd[name] = model_sd.pop(key)
        state: dict[Any, Any] = {}
        groups: list[dict[str, Any]] = []
        for optimizer, names in zip(optimizers, self.optim_names):
            osd = optimizer.state_dict()
            for number, entry in osd[_STATE].items():
                state[names[number]] = entry
            for group in osd[_PARAM_GROUPS]:
                group[_PARAMS] = [names[number] for number in group[_PARAMS]]
                groups.append(group)
        optim_sd: dict[str, Any] = {_STATE: state, _PARAM_GROUPS: groups} if optimizers else {}
        if optimizers and options.flatten_optimizer_state_dict:
            optim_sd = _flatten(optim_sd)
        return model_sd, optim_sd


def _name(model: torch.nn.Module, key: str) -> str:
    """The name ``get_state_dict`` gives a state-dict key: without the ``module.`` of a DDP wrapper and the
    ``_orig_mod.`` of ``torch.compile``'s (the comparison with torch's own result checks it)."""
    parts, kept, at = key.split("."), [], model
    for part in parts:
        wrapper = (part == "module" and isinstance(at, DistributedDataParallel)) or (
            part == "_orig_mod" and type(at).__name__ == "OptimizedModule")
        if not wrapper:
            kept.append(part)
        at = getattr(at, part, None) if isinstance(at, torch.nn.Module) else None
    return ".".join(kept)


def _has_grad(params: list[torch.Tensor]) -> bool:
    return any(p.grad is not None for p in params)


def _same(learnt: list[torch.Tensor], now: Iterable[torch.Tensor]) -> bool:
    now = list(now)
    return len(now) == len(learnt) and all(a is b for a, b in zip(learnt, now))


def _flatten(optim_sd: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state dict with ``flatten_optimizer_state_dict``: ``state.<name>.<key>`` (nested dicts joined
    with dots) and ``param_groups.<name>.<key>`` for every parameter of a group."""
    flat: dict[str, Any] = {}

    def nested(entry: dict[Any, Any], prefix: str) -> None:
        for key, value in entry.items():
            if isinstance(value, dict):
                nested(value, f"{prefix}.{key}")
            else:
                flat[f"{prefix}.{key}"] = value

    for name, entry in optim_sd[_STATE].items():
        nested(entry, f"{_STATE}.{name}")
    for group in optim_sd[_PARAM_GROUPS]:
        names = group.pop(_PARAMS)
        for name in names:
            for key, value in group.items():
                flat[f"{_PARAM_GROUPS}.{name}.{key}"] = value
    return flat


def _difference(expected: Any, got: Any, where: str = "") -> str | None:
    """Where ``got`` differs from ``expected`` (dicts by keys in order, tensors by type, shape, dtype and
    storage, anything else by ==), or None."""
    if isinstance(expected, dict):
        if not isinstance(got, dict) or list(expected) != list(got):
            return f"the keys of {where or 'the state dict'} differ"
        for key in expected:
            found = _difference(expected[key], got[key], f"{where}.{key}" if where else str(key))
            if found is not None:
                return found
        return None
    if isinstance(expected, (list, tuple)):
        if type(got) is not type(expected) or len(got) != len(expected):
            return f"{where} differs"
        for index, (a, b) in enumerate(zip(expected, got)):
            found = _difference(a, b, f"{where}[{index}]")
            if found is not None:
                return found
        return None
    if isinstance(expected, torch.Tensor):
        if type(got) is not type(expected) or got.shape != expected.shape or got.dtype != expected.dtype \
                or _storage(got) != _storage(expected):
            return f"the tensor {where} differs"
        return None
    return None if type(got) is type(expected) and got == expected else f"{where} differs"


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.data_ptr(), local.storage_offset()

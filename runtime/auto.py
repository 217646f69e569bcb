"""Auto-instrumentation: telemetry for an unchanged torchrun script.

The launcher (``trainwarden run``, the node daemon's jobs) puts ``runtime/bootstrap`` first on the workers'
PYTHONPATH; Python imports its ``sitecustomize`` at start-up, which calls `bootstrap()` and then loads the
``sitecustomize`` the user's path would have given (docs/ARCHITECTURE.md, "Auto-instrumentation", says why
this way rather than an entry wrapper). `bootstrap()` does nothing unless the process is a torchrun worker of
an instrumented job (``TRAINWARDEN_AUTO_INSTRUMENT=1``, an agent socket, ``RANK`` and ``LOCAL_RANK`` set) and
not a process started from one (``TRAINWARDEN_AUTO_PID`` names another pid: a spawned DataLoader worker, a
subprocess). It imports nothing heavy: it waits for the script's own ``import torch``, then

- wraps ``init_process_group`` (every binding of it torch made) so that, once the script's process group
  exists, the worker opens its telemetry session: the Flight Recorder is read, stacks can be dumped on the
  agent's request, the agent may abort the worker (what ``trainwarden.runtime.init()`` does);
- registers global optimizer-step hooks: the step boundaries, and before each step of the primary optimizer a
  check that its gradients are finite (``runtime/gradient_watch.py``'s ``GradientWatch``: a norm per gradient tensor on
  its device, read one step later on a GPU; a non-finite step is a ``numeric`` incident, detection only).

Step rule: one step per ``step()`` of the optimizer that steps first in the process (the *primary*); other
optimizers' steps are not counted (two optimizers stepping together give one step; gradient accumulation
gives one step per ``optimizer.step()``, not per micro-batch). A step GradScaler skips (inf/NaN gradients:
``optimizer.step()`` is not called) still counts as a step of the primary. LR schedulers do not matter. A
step's time runs from the end of the previous one (the first: from the process group's creation). The
``step()`` DCP's ``get_state_dict`` takes to create an optimizer's state (zero gradients, learning rate 0) is
not a step. Its index
is the optimizer's own step count when it keeps one on the CPU (Adam, AdamW: it survives the script's own
checkpoint, so a resumed job's indices go on), otherwise the boundaries counted in this process. Once the
script calls ``rt.step`` itself, that wins: the hooks stop counting.

Nothing here may change what the script does: no output, no exception into it (a failure to instrument is
one warning on stderr, and the script trains on), the same losses (nothing touches tensors).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
import time
import weakref
from typing import Callable, Mapping

from trainwarden.agent.shared.contract import (AGENT_SOCKET_ENV, AUTO_INSTRUMENT_ENV, AUTO_OWNER_ENV,
                                             TOKENS_PER_STEP_ENV)

STEP_RECORD = "step"
"""The telemetry client's tag of a queued step (agent_client.STEP_RECORD; not imported: that loads gRPC)."""

__all__ = ["OptimizerSteps", "bootstrap", "should_instrument"]

log = logging.getLogger(__name__)

STEP_SOURCE = "optimizer hooks"


def should_instrument(env: Mapping[str, str], pid: int) -> bool:
    """True for a torchrun worker of a job the launcher asked to instrument, and for no process started from
    one (see the module docstring)."""
    if env.get(AUTO_INSTRUMENT_ENV) != "1" or not env.get(AGENT_SOCKET_ENV):
        return False
    if "RANK" not in env or "LOCAL_RANK" not in env:  # torchrun's own process, or not a worker at all
        return False
    owner = env.get(AUTO_OWNER_ENV)
    return not owner or owner == str(pid)


_state_lock = threading.Lock()
_installed = False


def bootstrap(env: Mapping[str, str] | None = None) -> bool:
    """Arm auto-instrumentation in this process when it should be (`should_instrument`); True when armed.
    Called by the bootstrap ``sitecustomize`` and by warm workers after their fork."""
    global _installed
    env = os.environ if env is None else env
    if not should_instrument(env, os.getpid()):
        return False
    with _state_lock:
        if _installed:
            return True
        _installed = True
    os.environ[AUTO_OWNER_ENV] = str(os.getpid())  # what this process starts stays quiet
    if "torch" in sys.modules and hasattr(sys.modules["torch"], "optim"):
        _on_torch(sys.modules["torch"])  # already imported (a warm worker's zygote imported it)
    else:
        sys.meta_path.insert(0, _AfterImport("torch", _on_torch))
    return True


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` once ``name`` has been imported (its body ran), then steps aside."""

    def __init__(self, name: str, callback: Callable[[object], None]) -> None:
        self._name, self._callback = name, callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self._name:
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, callback = spec.loader, self._callback
        exec_module = loader.exec_module

        def exec_then_call(module):
            exec_module(module)
            try:
                callback(module)
            except Exception as exc:  # never into the script's import
                _warn(f"could not instrument this worker ({type(exc).__name__}: {exc}); it trains without "
                      "trainwarden's step times and hang detection")

        loader.exec_module = exec_then_call
        return spec


def _warn(message: str) -> None:
    print(f"trainwarden: {message}", file=sys.stderr, flush=True)


_steps: "OptimizerSteps | None" = None


def _on_torch(torch) -> None:
    """torch is imported: wrap init_process_group, register the optimizer hooks, wrap GradScaler.step."""
    global _steps, _Tensor
    _Tensor = getattr(torch, "Tensor", None)
    steps = _steps = OptimizerSteps(tokens=_tokens_per_step(os.environ))
    optimizer = sys.modules.get("torch.optim.optimizer")
    if optimizer is not None and hasattr(optimizer, "register_optimizer_step_post_hook"):
        optimizer.register_optimizer_step_post_hook(steps.on_optimizer_step)
        if hasattr(optimizer, "register_optimizer_step_pre_hook"):
            optimizer.register_optimizer_step_pre_hook(steps.before_optimizer_step)
    _wrap_grad_scaler(steps)
    state_dict = sys.modules.get(_DCP_STATE_DICT)
    if state_dict is not None:
        _wrap_optimizer_state_init(state_dict, steps)
    else:
        sys.meta_path.insert(0, _AfterImport(_DCP_STATE_DICT, lambda m: _wrap_optimizer_state_init(m, steps)))
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    original = getattr(c10d, "init_process_group", None) if c10d is not None else None
    if original is None:
        return  # a torch built without distributed: the hooks still wait for a process group, in vain
    if getattr(c10d, "is_initialized", lambda: False)():
        steps.start_session()
        return

    def init_process_group(*args, **kwargs):
        result = original(*args, **kwargs)
        steps.start_session()
        return result

    init_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    init_process_group.__doc__, init_process_group.__name__ = original.__doc__, original.__name__
    init_process_group.__qualname__ = original.__qualname__
    for module in list(sys.modules.values()):  # every binding torch made (device_mesh imports it by name)
        if getattr(module, "__name__", "").startswith("torch") and \
                module.__dict__.get("init_process_group") is original:
            module.init_process_group = init_process_group


_DCP_STATE_DICT = "torch.distributed.checkpoint.state_dict"


def _wrap_optimizer_state_init(module, steps: "OptimizerSteps") -> None:
    """DCP's ``get_state_dict`` creates an empty optimizer's state by calling its ``step()`` with zero gradients
    and a learning rate of 0 (``_init_optim_state``): not a training step. The hook ignores steps taken while it
    runs."""
    original = getattr(module, "_init_optim_state", None)
    if original is None or getattr(original, "_trainwarden", False):
        return

    def _init_optim_state(*args, **kwargs):
        steps.initializing += 1
        try:
            return original(*args, **kwargs)
        finally:
            steps.initializing -= 1

    _init_optim_state._trainwarden = True  # type: ignore[attr-defined]
    _init_optim_state.__wrapped__ = original  # type: ignore[attr-defined]
    module._init_optim_state = _init_optim_state


def _wrap_grad_scaler(steps: "OptimizerSteps") -> None:
    grad_scaler = sys.modules.get("torch.amp.grad_scaler")
    scaler = getattr(grad_scaler, "GradScaler", None) if grad_scaler is not None else None
    if scaler is None or getattr(scaler.step, "_trainwarden", False):
        return
    original = scaler.step

    def step(self, optimizer, *args, **kwargs):
        before = steps.boundaries
        result = original(self, optimizer, *args, **kwargs)
        if steps.boundaries == before:  # the scaler skipped optimizer.step(): inf/NaN gradients
            steps.on_optimizer_step(optimizer, args, kwargs)
        return result

    step._trainwarden = True  # type: ignore[attr-defined]
    step.__wrapped__ = original  # type: ignore[attr-defined]
    step.__doc__, step.__name__, step.__qualname__ = original.__doc__, original.__name__, original.__qualname__
    scaler.step = step


def _tokens_per_step(env: Mapping[str, str]) -> int:
    raw = env.get(TOKENS_PER_STEP_ENV, "")
    if not raw:
        return 0
    try:
        value = int(raw)
        if value < 0:
            raise ValueError
        return value
    except ValueError:
        _warn(f"{TOKENS_PER_STEP_ENV}={raw!r} is not a whole number of tokens (0 or more); reporting steps/s only")
        return 0


class OptimizerSteps:
    """Step boundaries from the global optimizer-step hook (the rule is in the module docstring).

    ``on_optimizer_step`` runs on the training thread after every optimizer step: a few attribute reads, two
    clock reads and one append to the telemetry client's queue. It never raises."""

    def __init__(self, *, tokens: int = 0, clock_ns: Callable[[], int] = time.monotonic_ns,
                 wall_ns: Callable[[], int] = time.time_ns) -> None:
        self.tokens = tokens
        self.session = None
        self.initializing = 0
        """Above 0 while DCP initializes an optimizer's state with a step that trains nothing."""
        self.boundaries = 0
        """Boundaries of the primary optimizer seen (a GradScaler's skipped step included)."""
        self._primary: "weakref.ref | None" = None
        self._clock_ns, self._wall_ns = clock_ns, wall_ns
        self._last_wall = self._last_mono = 0
        self._gpu = None  # the CUDA event token of the step under way (Session._gpu_begin)
        self._watch = None  # runtime/gradient_watch.py's GradientWatch, once the session is open

    def start_session(self) -> None:
        """The process group exists: open the telemetry session (once)."""
        if self.session is not None:
            return
        try:
            from . import session as session_module

            self.session = session_module.init(step_source=STEP_SOURCE)
        except Exception as exc:
            _warn(f"could not connect this worker to the trainwarden agent ({type(exc).__name__}: {exc}); "
                  "it trains without step times and hang detection")
            return
        self._last_wall, self._last_mono = self._wall_ns(), self._clock_ns()
        if self.session.enabled:
            from .gradient_watch import GradientWatch

            session = self.session
            self._watch = GradientWatch(lambda step, detail: session.numeric_event(
                "nan", step, first_rank=session.rank, action="alerted", detail=detail))

    def before_optimizer_step(self, optimizer, args=None, kwargs=None) -> None:
        """The primary optimizer is about to step: the gradient watch takes its gradients' norms (never raises)."""
        try:
            watch, primary = self._watch, self._primary
            if watch is not None and not self.initializing and (primary is None or primary() is optimizer):
                watch.before_step(optimizer)
        except Exception:
            pass

    def on_optimizer_step(self, optimizer, args=None, kwargs=None) -> None:
        try:
            if self.initializing:
                return
            primary = self._primary
            if primary is None:
                self._primary = weakref.ref(optimizer)
            elif primary() is not optimizer:
                if primary() is not None:
                    return
                self._primary = weakref.ref(optimizer)  # the primary is gone: the next one to step takes over
            self.boundaries += 1
            session = self.session
            if session is None:
                return
            if session._manual_steps:  # the script reports its own steps (rt.step): that wins
                return
            client = session._client
            if client is None:
                return
            index = _step_index(optimizer, self.boundaries)
            mono, wall = self._clock_ns(), self._wall_ns()
            start_wall, start_mono = self._last_wall, self._last_mono
            if self._watch is not None:
                self._watch.after_step(index, (mono - start_mono) / 1e9)
            self._last_wall, self._last_mono = wall, mono
            # one boundary ends a step and starts the next: on CUDA, the GPU's time between the two
            token, self._gpu = self._gpu, session._gpu_begin()
            session._emit_step((STEP_RECORD, index, start_wall, mono - start_mono,
                                self.tokens, None), token)
        except Exception:
            pass


_Tensor = None  # torch.Tensor, once torch is imported


def _step_index(optimizer, boundaries: int) -> int:
    """The optimizer's own count of steps, minus one, when it keeps one in a plain CPU tensor (or a number);
    else ``boundaries - 1``. A GPU tensor is never read here (that would synchronize), nor a tensor subclass
    (a DTensor's value may take a collective)."""
    try:
        state = optimizer.state.get(optimizer.param_groups[0]["params"][0])
        if state:
            count = state.get("step")
            if isinstance(count, (int, float)):
                return max(0, int(count) - 1)
            if type(count) is _Tensor and count.device.type == "cpu":
                return max(0, int(count) - 1)
    except Exception:
        pass
    return boundaries - 1

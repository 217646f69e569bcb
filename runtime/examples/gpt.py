"""The reference 3-D parallel workload: a small GPT trained on synthetic data under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 8 \\
        -m trainwarden.runtime.examples.gpt --dp 2 --tp 2 --pp 2 --steps 20 --ckpt-dir /tmp/ckpt

Every rank builds the same full model from ``--seed``, keeps its pipeline stage and shards it
(:mod:`trainwarden.runtime.examples.parallel`); data is a pure function of ``(seed, step, sample)``
(:mod:`trainwarden.runtime.examples.data`). Steps are numbered from 1. The last stage's first rank logs one line per
step (``step S loss L time Ts tok/s R``, loss with six decimals so that runs compare exactly) and finally
``done steps=N final_loss=L``.

Checkpoints: after step ``s`` with ``s % --ckpt-every == 0`` the app state (:class:`TrainState`: model
part, optimizer, step, data position; plus the per-rank ``RNGState``) is handed to :class:`trainwarden.runtime.checkpoint.Checkpointer`,
which saves it asynchronously as checkpoint "step s". At start-up the newest complete checkpoint is
restored and training resumes at ``s + 1``. Model and optimizer go through
``torch.distributed.checkpoint.state_dict`` so they are keyed by fully-qualified parameter names and DCP
reshards them into a different mesh. After every step (``--snapshot-every``) the same state is also snapshotted into
the node agent's shared memory when ``trainwarden run`` keeps one (:mod:`trainwarden.runtime.checkpoint.memory_snapshot`):
a restart after a crash or a hang resumes from the step before it instead of the last disk checkpoint. Because the data and the learning rate depend only on the step, a
resumed run reproduces an uninterrupted one bit for bit on the same mesh.

Fault injection (:mod:`trainwarden.runtime.faults`, ``TRAINWARDEN_FAULTS``) is consulted at the start of
every step, before any collective.

Between the backward pass and the optimizer step, :class:`trainwarden.runtime.numeric.NumericGuard` checks every
rank's own loss and gradients and the ranks agree on what they saw: a step with a non-finite value is rolled back
(its update skipped on every rank, its batch not trained on), or stops the run, or is only reported
(``--numeric-policy``). On a GPU the AdamW is fused and the check deferred: the skip is taken on the device at its
step, the incident (or the stop) comes a step later (runtime/numeric_defer.py); on the CPU it is synchronous, as before.
The ``nan`` fault poisons a rank's loss to test it. With ``--sdc-every N`` the data-parallel
replicas recompute one micro-batch's gradient every N steps and compare it bitwise
(:mod:`trainwarden.runtime.sdc_check`); the ``gradflip`` fault corrupts one to test it.

With ``TRAINWARDEN_TIMINGS`` set, every rank marks the end of its start-up phases (imports done, default
process group up, mesh up, model built, checkpoint restored, first step) for the restart breakdown benchmark
(:mod:`trainwarden.runtime.examples.timings`, tests/bench/bench_restart.py); unset, nothing is recorded.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Any, NoReturn, Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

import trainwarden.runtime
from trainwarden.agent.shared.contract import (EXIT_NUMERIC_STOP, EXIT_RESUME_BLOCKED,
                                              PEER_GONE)
from trainwarden.runtime.checkpoint import Checkpointer, CheckpointUnloadableError, RNGState
from trainwarden.runtime.examples.data import DataConfig, DataConfigError, SyntheticData
from trainwarden.runtime.peer_failure import peer_failure
from trainwarden.runtime.faults import FaultInjector, FaultSpecError
from trainwarden.runtime.examples.model import ModelConfigError
from trainwarden.runtime.numeric import NumericStop
from trainwarden.runtime.examples.parallel import (MeshError, backend_for, build_mesh,
                                          build_parallel_model, pick_device)
from trainwarden.runtime.checkpoint.state_dict_reader import StateDictReader
from trainwarden.runtime.examples.timings import PhaseTimings

_IMPORTED_AT = time.time()
"""When this module's imports (torch among them) were done: the restart benchmark's "torch imported" mark."""

__all__ = ["EXIT_OK", "EXIT_TRAINING_FAILED", "EXIT_BAD_CONFIG", "TrainConfig", "TrainState", "parse_args", "train", "main"]

log = logging.getLogger("trainwarden.runtime.examples.gpt")

EXIT_OK = 0
EXIT_TRAINING_FAILED = 1
"""Training raised; a restart from the last checkpoint may help."""
EXIT_BAD_CONFIG = 2
"""Flags, mesh or fault specification are invalid: fix the command line, a restart will not help."""
EXIT_NO_CHECKPOINT = EXIT_RESUME_BLOCKED
"""Checkpoints exist (or were committed) but none can be read or loaded: fix the storage or put one back
(`trainwarden checkpoints`), or pass --allow-fresh-start. The launcher stops the job without a restart."""


from trainwarden.runtime.examples.gpt_config import TrainConfig, parse_args  # noqa: F401 (re-exported)


# Optimizer state keyed by parameter FQN (``param_groups.<fqn>.lr``), not by group index: pipeline stages own
# different parameters, and index-keyed groups ("param_groups.0.params") from different stages would
# collide in DCP's deduplication, so a stage would load another stage's groups.
_SD_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class TrainState(Stateful):
    """The app state in a checkpoint: this rank's model part and optimizer, step and data position.

    Model and optimizer state dicts come from ``get_state_dict`` (fully-qualified names, DTensor shards,
    optimizer flattened per parameter), so DCP reshards them into any mesh and pipeline layout. The data position is the last completed step (the data is a pure
    function of the step). RNG state is saved next to it as the Checkpointer's per-rank ``RNGState``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self.step = 0
        self._reader = StateDictReader(model, optimizer, options=_SD_OPTIONS)

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = self._reader.read()  # get_state_dict's, the names worked out once
        return {"model": model_sd, "optim": optim_sd, "step": self.step, "data_position": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"], options=_SD_OPTIONS)
        self.step = int(state_dict["step"])
        if int(state_dict["data_position"]) != self.step:
            raise ValueError(f"checkpoint data position {state_dict['data_position']} != step {self.step}")


def train(cfg: TrainConfig, device: torch.device, *, timings: PhaseTimings | None = None) -> float:
    """Run (or resume) training up to ``cfg.steps`` in the initialised process group; the final loss
    on the reporting rank, NaN elsewhere or if no step ran. ``timings`` marks the start-up phases
    (runtime/examples/timings.py; off unless ``TRAINWARDEN_TIMINGS`` is set)."""
    if timings is None:
        timings = PhaseTimings(None, rank=dist.get_rank())
    faults = FaultInjector.from_env(rank=dist.get_rank())
    mesh = build_mesh(cfg.mesh, device)
    timings.mark("mesh_up")
    torch.manual_seed(cfg.seed)
    micro_batch = None if cfg.infer_pipeline_shapes else cfg.batch // (cfg.mesh.dp * cfg.mesh.micro_batches)
    pm = build_parallel_model(cfg.model, cfg.mesh, mesh, device, seed=cfg.seed, micro_batch=micro_batch)
    if cfg.micro_batch_size and cfg.mesh.pp == 1:  # the pipeline schedule runs its own micro-batches
        pm.accumulate = cfg.mesh.micro_batches
    # fused on a GPU: the guard's check is then deferred (runtime/numeric_defer.py), its skip taken on the device
    optimizer = torch.optim.AdamW(pm.model.parameters(), lr=cfg.lr_at(1), weight_decay=0.01,
                                  **({"fused": True} if device.type == "cuda" else {}))
    data = SyntheticData(DataConfig(vocab=cfg.model.vocab, seq=cfg.model.seq, batch=cfg.batch, seed=cfg.seed))
    train_state = TrainState(pm.model, optimizer)

    rt = trainwarden.runtime.init(mesh={"pp": cfg.mesh.pp, "dp": cfg.mesh.dp, "tp": cfg.mesh.tp})
    guard = rt.numeric_guard(policy=cfg.numeric_policy, device=device)
    sdc = _sdc_check(cfg, pm, device, rt) if cfg.sdc_every else None

    timings.mark("model_built")
    ckpt_state = {"app": train_state, "rng": RNGState()}
    ckpt, start = _restore(cfg, ckpt_state, train_state, rt, faults)
    timings.mark("restored")

    tokens_per_step = cfg.batch * cfg.model.seq
    if dist.get_rank() == 0:
        _describe_job(cfg, tokens_per_step, micro_batch)
    loss_value = math.nan
    last_seconds: float | None = None
    # this rank's share of the tokens: the job's throughput is the sum over ranks
    tokens_per_rank = tokens_per_step // max(1, dist.get_world_size())
    for step in range(start, cfg.steps + 1):
        began = time.monotonic()
        with rt.step(step, tokens=tokens_per_rank):
            # inside the step: a `slow` rank's delay is its own compute time, as a throttled GPU's would be
            faults.step_boundary(step, last_seconds)
            if cfg.step_pad_s:
                time.sleep(cfg.step_pad_s)
            for group in optimizer.param_groups:
                group["lr"] = cfg.lr_at(step)
            optimizer.zero_grad(set_to_none=True)
            inputs, targets = data.batch(step, pm.dp_rank, cfg.mesh.dp)
            loss = pm.train_step(inputs, targets, poison=faults.take_poison())
            applied = guard.check(step, loss=pm.local_loss, parameters=pm.model.parameters(), optimizer=optimizer)
            if applied:  # on a GPU always: a skipped step's update is skipped on the device, reported a step later
                optimizer.step()  # else every rank skips the update: the state stays the one before this step
            if sdc is not None and sdc[0].due(step):
                _check_replicas(step, sdc, pm, inputs, targets, flip=faults.take_gradflip(step))
        train_state.step = step
        if step == start:
            timings.mark("first_step")
        if loss is not None:
            loss_value = loss.item()
        last_seconds = time.monotonic() - began
        if pm.is_reporter and (step % cfg.log_every == 0 or step == cfg.steps):
            log.info("step %d loss %.6f time %.3fs tok/s %.0f%s", step, loss_value, last_seconds,
                     tokens_per_step / last_seconds, "" if applied else
                     f" (rolled back: {'loss spike' if guard.events[-1].kind == 'loss_spike' else 'not finite'})")
        requested = rt.take_checkpoint_request(step)  # the agent's "checkpoint now" (at this step)
        if ckpt is not None and cfg.snapshot_every and step % cfg.snapshot_every == 0:
            ckpt.snapshot(step, ckpt_state)  # a host copy; written to the agent's memory in the background
        if ckpt is not None and (step % cfg.ckpt_every == 0 or requested):
            ckpt.save(step, ckpt_state)
    guard.flush()  # a deferred check's last step: its incident, or its stop
    if ckpt is not None:
        ckpt.close()    # waits for the last save to commit
    rt.close()
    if pm.is_reporter:
        log.info("done steps=%d final_loss=%.6f", cfg.steps, loss_value)
    return loss_value if pm.is_reporter else math.nan


def _restore(cfg: TrainConfig, ckpt_state: dict, train_state: TrainState, rt, faults: FaultInjector):
    """The job's Checkpointer (None without ``--ckpt-dir``) and the first step to train, after a restore."""
    if cfg.ckpt_dir is None:
        return None, 1
    # the Checkpointer reports its stages to the agent itself (the watchdog's checkpoint allowance, the etcd
    # pointer, failure incidents); a slow_save fault blocks inside the save, as slow storage would, and a snapflip
    # fault corrupts a memory snapshot once it is written
    ckpt = Checkpointer(cfg.ckpt_dir, keep=cfg.keep, session=rt, before_save=faults.before_save,
                        after_snapshot=faults.after_snapshot)
    restored = ckpt.restore(ckpt_state, allow_fresh_start=cfg.allow_fresh_start)
    if restored is None:
        return ckpt, 1
    if restored != train_state.step:
        raise RuntimeError(f"checkpoint 'step {restored}' holds app state for step {train_state.step}")
    log.info("resumed from checkpoint step %d in %s", restored, cfg.ckpt_dir)
    return ckpt, restored + 1


def _describe_job(cfg: TrainConfig, tokens_per_step: int, micro_batch: int | None) -> None:
    log.info("model: %d parameters in its matmuls, %d tokens per step (for the MFU: trainwarden run "
             "--model-params %d)", cfg.model.matmul_params, tokens_per_step, cfg.model.matmul_params)
    if cfg.mesh.pp > 1:
        log.info("pipeline: %d stages, %d micro-batches a step; %s", cfg.mesh.pp, cfg.mesh.micro_batches,
                 f"stages built with their shapes ({micro_batch} sequences a micro-batch)" if micro_batch
                 else "stages infer their shapes on the first step")


def _sdc_check(cfg: TrainConfig, pm, device: torch.device, rt):
    """The silent-corruption check and its probe (a plain replica of this rank's stage: the whole model without a
    pipeline), or None without replicas."""
    if cfg.mesh.dp < 2:
        log.warning("--sdc-every %d: no data-parallel replica to compare with (--dp 1): the check is off",
                    cfg.sdc_every)
        return None
    from trainwarden.runtime.examples.model import build_model, split_for_stage
    from trainwarden.runtime.examples.parallel import lm_loss
    from trainwarden.runtime.sdc_check import ReplicaProbe, SdcCheck

    replica = split_for_stage(build_model(cfg.model, seed=cfg.seed), pm.pp_rank, cfg.mesh.pp).to(device)
    loss = lm_loss if replica.output is not None else _projected
    return SdcCheck(rt, every=cfg.sdc_every, group=pm.mesh["dp"].get_group()), ReplicaProbe(pm.model, replica, loss)


def _projected(outputs: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """A stage before the last has no loss of its own: its outputs' mean along a fixed random projection."""
    return (outputs.float() * projection.float()).mean()


def _probe_batch(step: int, check, pm, inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    """What every replica of this rank's stage computes the probe gradient of: one replica's first micro-batch
    (rotating), broadcast over the data-parallel group. In a pipeline each stage is checked on its own: a stage
    after the first takes hidden states and a stage before the last is given a projection of its outputs, both
    drawn from the step, the same on every replica (so a replica's wrong earlier stage cannot make its later ones
    look wrong, and no activation crosses a stage for the check)."""
    group, model = pm.mesh["dp"].get_group(), pm.model
    size = max(1, len(inputs) // max(1, pm.cfg.micro_batches))
    shared = [inputs[:size].to(pm.device).contiguous(), targets[:size].to(pm.device).contiguous()]
    for t in shared:  # the owner's micro-batch, on every replica
        dist.broadcast(t, group=group, group_src=check.owner(step))
    cfg, dtype = model.cfg, next(p.dtype for p in model.parameters() if p.is_floating_point())
    drawn = torch.Generator().manual_seed(step)
    if model.tok_embeddings is None:
        shared[0] = torch.randn((size, cfg.seq, cfg.dim), generator=drawn, dtype=dtype).to(pm.device)
    if model.output is None:
        shared[1] = torch.randn((size, cfg.seq, cfg.dim), generator=drawn, dtype=dtype).to(pm.device)
    return shared


def _check_replicas(step: int, sdc, pm, inputs: torch.Tensor, targets: torch.Tensor, *, flip: bool) -> None:
    """Every data-parallel replica computes the probe's gradient (``_probe_batch``) on the current weights, and the
    check compares them bitwise. ``flip``: the ``gradflip`` fault corrupts this rank's first result."""
    from trainwarden.runtime.faults import flip_gradient_bit

    check, probe = sdc
    began = time.perf_counter()
    shared = _probe_batch(step, check, pm, inputs, targets)
    probe.load()
    calls = [0]

    def compute():
        grads = probe.gradients(*shared)
        if flip and calls[0] == 0:
            log.warning("injecting fault gradflip at step %d: %s", step, flip_gradient_bit(grads))
        calls[0] += 1
        return grads

    event = check.check(step, compute)
    if pm.is_reporter:
        log.info("silent-corruption check at step %d: %s (%.1f ms on this rank)", step,
                 "the replicas agree" if event is None else f"rank(s) {', '.join(map(str, event.ranks))} differ",
                 (time.perf_counter() - began) * 1e3)


class _RankFilter(logging.Filter):
    def __init__(self, rank: str) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def _setup_logging(rank: str) -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.addFilter(_RankFilter(rank))
    handler.setFormatter(logging.Formatter("%(asctime)s [rank %(rank)s] %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", "0"))
    _setup_logging(str(rank))
    try:
        cfg = parse_args(argv)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        cfg.mesh.check(world_size=world, model=cfg.model, batch=cfg.batch)
    except (MeshError, ModelConfigError, DataConfigError, ValueError) as exc:   # all ValueErrors
        # every rank says it: the first to exit makes torchrun stop the others, perhaps before rank 0 has said it
        log.error("bad configuration: %s", exc)
        return EXIT_BAD_CONFIG
    timings = PhaseTimings.from_env(rank=rank)
    timings.mark("imported", _IMPORTED_AT)
    device = pick_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend_for(device))
    timings.mark("pg_up")
    try:
        train(cfg, device, timings=timings)
    except FaultSpecError as exc:
        _exit_now(EXIT_BAD_CONFIG, f"bad TRAINWARDEN_FAULTS: {exc}")
    except NumericStop as exc:  # the first rank logged the values it saw
        _exit_now(EXIT_NUMERIC_STOP, f"stopping (exit {EXIT_NUMERIC_STOP}): {exc}; the launcher does not restart "
                  "the job, which would compute the same values again", reason=f"numeric stop: {exc}"[:200])
    except CheckpointUnloadableError as exc:  # rank 0's Checkpointer logged why and what to do: one line here
        _exit_now(EXIT_NO_CHECKPOINT, f"stopping (exit {EXIT_NO_CHECKPOINT}): the job has checkpoints it could not "
                  "load, and it does not start over by itself; rank 0's error says why and what to do",
                  reason=str(exc))
    except Exception as exc:
        lost = peer_failure(exc)
        if lost:  # the echo of another rank's failure: one line, the failed rank has the traceback
            _exit_now(EXIT_TRAINING_FAILED, f"a peer rank is gone ({lost}); exiting so torchrun restarts the group",
                      reason=f"{PEER_GONE}: {lost}")
        log.exception("training failed")
        _exit_now(EXIT_TRAINING_FAILED, "exiting without a clean shutdown")
    dist.destroy_process_group()
    return EXIT_OK


def _exit_now(code: int, message: str, reason: str | None = None) -> None:
    """Log and leave at once. After a failure the peers may be blocked in collectives with this rank,
    and a clean exit (destroying process groups, joining the checkpoint threads) could wait for them
    forever; torchrun notices the exit code and tears the group down."""
    log.error(message)
    trainwarden.runtime.goodbye(reason or message)  # tells the agent this rank left on purpose, and why
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _leave(code: int) -> NoReturn:
    """End the process as the interpreter would, minus its teardown of modules: a rank that has loaded torch spends
    seconds in it after its work is done (py-spy on 4 ranks on this 2-core machine: no Python frame, torch's
    ``_del_library``, 5.4 s from ``done`` to torchrun seeing the group finished). What the interpreter does before
    that teardown is done here: threads' exit hooks and the join of non-daemon threads (``threading._shutdown``),
    then the ``atexit`` functions (the telemetry session's close), then the logs and streams are flushed. The
    reference job keeps nothing else that a finalizer would write; a script of your own that does should end
    normally."""
    import atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


if __name__ == "__main__":
    _leave(main())

"""Benchmark: how long a training step blocks for an asynchronous checkpoint vs a synchronous ``dcp.save``.

Run under torchrun (gloo on CPU works; the goal is measured at 8 ranks)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 python -m torch.distributed.run --standalone --nproc-per-node 8 \\
        tests/bench/bench_checkpoint.py --model reference --layers 8 --width 512 --repeats 5

``--model reference`` (the default) checkpoints the reference GPT job's own state (model part, optimizer,
step; pp2 x tp2 x dp2); ``--model stack`` an FSDP2 stack of Linear layers at any world size.

The stack model is an FSDP2-sharded stack of ``--layers`` square Linear layers (``width``² fp32 each) with AdamW
state after one step, so the checkpoint holds about 3 × the parameter bytes. In the same run it measures,
per repetition and as the maximum over ranks (the step waits for the slowest rank):

* async: ``Checkpointer.save`` blocking time (the host staging copy into reused buffers) and the time until
  the checkpoint is committed; the first, cold save (which allocates the buffers) is reported separately,
  and so is the median over ranks (with more ranks than cores, the slowest rank's number is mostly time
  spent waiting for a core);
* sync: ``dcp.save`` of the same state on the same gloo group, writer and directory kind;
* restore: ``Checkpointer.restore`` of the newest checkpoint.

It prints medians and the ratio async-blocking / sync-save (goal: < 10 %).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainwarden.runtime.checkpoint import Checkpointer, ModelState, RNGState


def build(layers: int, width: int, world: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def build_reference(args, world: int):
    """The reference job's model (runtime/examples/gpt.py) on a pp2 x tp2 x dp2 mesh, after one step,
    wrapped in the job's own checkpoint state (TrainState)."""
    from trainwarden.runtime.examples.data import DataConfig, SyntheticData
    from trainwarden.runtime.examples.gpt import TrainState
    from trainwarden.runtime.examples.model import ModelConfig, build_model
    from trainwarden.runtime.examples.parallel import MeshConfig, build_mesh, build_parallel_model, pick_device

    if world != 8:
        raise SystemExit("--model reference needs 8 ranks (pp2 x tp2 x dp2)")
    device = pick_device(int(__import__("os").environ.get("LOCAL_RANK", "0")))
    model_cfg = ModelConfig(vocab=args.vocab, dim=args.width, heads=8, layers=args.layers, seq=64)
    mesh_cfg = MeshConfig(dp=2, tp=2, pp=2, micro_batches=2)
    pm = build_parallel_model(model_cfg, mesh_cfg, build_mesh(mesh_cfg, device), device, seed=0)
    optim = torch.optim.AdamW(pm.model.parameters(), lr=1e-3)
    data = SyntheticData(DataConfig(vocab=args.vocab, seq=64, batch=8, seed=0))
    inputs, targets = data.batch(1, pm.dp_rank, 2)
    pm.train_step(inputs, targets)
    optim.step()
    optim.zero_grad()
    params = sum(p.numel() for p in build_model(model_cfg, seed=0).parameters())  # the whole model
    return TrainState(pm.model, optim), params * 4 / 2**20


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def per_rank(seconds: float) -> list[float]:
    out = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([seconds], dtype=torch.float64))
    return [float(t.item()) for t in out]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["reference", "stack"], default="reference",
                    help="reference: the reference GPT job (8 ranks, pp2 x tp2 x dp2, width = model dim); "
                         "stack: an FSDP2 stack of square Linear layers")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary of the reference model")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory, removed after)")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.model == "reference":
        train_state, params_mb = build_reference(args, world)
        state = {"app": train_state, "rng": RNGState()}
    else:
        model, optim = build(args.layers, args.width, world)
        state = {"train": ModelState(model, optim), "rng": RNGState()}
        params_mb = args.layers * args.width * args.width * 4 / 2**20
    root_box = [args.dir or (tempfile.mkdtemp(prefix="tw-bench-ckpt-") if rank == 0 else None)]
    dist.broadcast_object_list(root_box, src=0)
    root = Path(root_box[0])

    ckpt = Checkpointer(root / "async", keep=2)
    dist.barrier()
    ckpt.save(0, state)
    cold_stall = slowest(ckpt.last_stall_seconds)
    ckpt.wait()
    stalls, rank_stalls, totals, syncs = [], [], [], []
    sync_pg = dist.new_group(backend="gloo")
    for i in range(1, args.repeats + 1):
        dist.barrier()
        ckpt.save(i, state)
        ranks = per_rank(ckpt.last_stall_seconds)
        stalls.append(max(ranks))
        rank_stalls.extend(ranks)
        ckpt.wait()
        totals.append(slowest(ckpt.last_save_seconds))

        dist.barrier()
        start = time.monotonic()
        dcp.save(state, checkpoint_id=str(root / "sync" / f"step-{i}"), process_group=sync_pg)
        syncs.append(slowest(time.monotonic() - start))

    dist.barrier()
    start = time.monotonic()
    step = ckpt.restore(state)
    restore = slowest(time.monotonic() - start)
    ckpt_bytes = ckpt.last_committed.bytes if ckpt.last_committed else 0
    ckpt.close()
    dist.destroy_process_group(sync_pg)

    if rank == 0:
        stall, total, sync = statistics.median(stalls), statistics.median(totals), statistics.median(syncs)
        print(f"model={args.model} world={world} params={params_mb:.1f}MiB checkpoint={ckpt_bytes / 2**20:.1f}MiB "
              f"repeats={args.repeats} (max over ranks, median over repeats)")
        print(f"async save: blocking {stall * 1e3:.1f} ms (cold first save {cold_stall * 1e3:.1f} ms), "
              f"until committed {total * 1e3:.1f} ms; blocking of the median rank "
              f"{statistics.median(rank_stalls) * 1e3:.1f} ms")
        print(f"sync dcp.save: {sync * 1e3:.1f} ms")
        print(f"restore (step {step}): {restore * 1e3:.1f} ms")
        print(f"ratio async blocking / sync save = {stall / sync:.3f} (goal < 0.10); "
              f"restore / sync save = {restore / sync:.2f}")
        print(f"per-repeat blocking ms {[round(s * 1e3, 1) for s in stalls]}, "
              f"sync ms {[round(s * 1e3, 1) for s in syncs]}")
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

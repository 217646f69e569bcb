"""A user's own training script, not the reference job: a plain MLP under DistributedDataParallel (gloo),
reporting every step through `rt.step` and printing nothing in trainwarden's log format.

    torchrun --nproc-per-node 4 tests/jobs/ddp_mlp.py --steps 200 [--width 256] [--sleep-ms 0]
             [--ckpt-dir DIR --ckpt-every N] [--num-workers 2] [--fsdp]

Each step trains one batch; --width sets its compute (on this 2-core box, 4 ranks at width 512 take about
25 ms a step). --sleep-ms adds a fixed wait inside every step before the forward pass, standing in for time
a GPU job spends on the device (so long steps do not need long CPU work). With --ckpt-dir it saves with
trainwarden's Checkpointer every --ckpt-every steps and resumes from the newest complete checkpoint.
--num-workers > 0 feeds batches through a forking DataLoader. --fsdp wraps the model with FSDP2
(fully_shard) instead of DDP.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn

import trainwarden.runtime
from trainwarden.runtime.faults import FaultInjector


class Batches(torch.utils.data.Dataset):
    """Deterministic synthetic regression data: item i is a function of (seed, i)."""

    def __init__(self, width: int, batch: int, length: int) -> None:
        self.width, self.batch, self.length = width, batch, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        g = torch.Generator().manual_seed(1000 + index)
        x = torch.randn(self.batch, self.width, generator=g)
        return x, x.sum(dim=1, keepdim=True) * 0.01


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--sleep-ms", type=float, default=0.0)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--fsdp", action="store_true")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, args.width),
                          nn.ReLU(), nn.Linear(args.width, 1))
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rt = trainwarden.runtime.init(mesh={"dp": world})
    faults = FaultInjector.from_env(rank=rank)  # TRAINWARDEN_FAULTS, for the tests' slow and crashing ranks

    start = 1
    ckpt = None
    if args.ckpt_dir:
        from trainwarden.runtime.checkpoint import Checkpointer, ModelState

        state = {"model": ModelState(model, optimizer)}
        ckpt = Checkpointer(args.ckpt_dir, keep=2)
        restored = ckpt.restore(state)
        start = (restored or 0) + 1

    data = Batches(args.width, args.batch, args.steps * world + world)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.Subset(data, range(rank + (start - 1) * world, len(data), world)),
        batch_size=None, num_workers=args.num_workers, persistent_workers=args.num_workers > 0)
    batches = iter(loader)
    last = None
    for step in range(start, args.steps + 1):
        began = time.monotonic()
        with rt.step(step, tokens=args.batch):
            faults.step_boundary(step, last)
            if args.sleep_ms:
                time.sleep(args.sleep_ms / 1000)
            x, y = next(batches)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        last = time.monotonic() - began
        if ckpt is not None and step % args.ckpt_every == 0:
            ckpt.save(step, state)
    if ckpt is not None:
        ckpt.close()
    if rank == 0:
        print(f"trained {args.steps} steps, final loss {loss.item():.4f}", flush=True)
    rt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

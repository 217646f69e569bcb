"""A worker that joins a gloo process group and all-reduces forever, printing step lines."""

import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
with open(os.path.join(os.environ["PIDS_DIR"], f"rank{rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
step = 0
while True:
    t0 = time.monotonic()
    x = torch.ones(4)
    dist.all_reduce(x)
    step += 1
    if rank == 0:
        print(f"step {step} loss {x[0].item():.6f} time {time.monotonic() - t0:.3f}s", flush=True)
    time.sleep(0.2)

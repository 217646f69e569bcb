"""A job that crashes on purpose until its restarts are spent, for the warm-restart stress (issue 45,
tests/bench/warm_restarts.py): in every round but the last one rank ends itself at step --crash-step; the last
round (restart count == --crashes) trains --steps steps and the job succeeds.

    trainwarden run --nproc-per-node 2 --max-restarts N -- tests/jobs/crash_loop.py --crashes N --record FILE

The crashing rank turns with the round (restart r: rank r % world) and so does its exit code (``--crash exit``:
``os._exit`` with 1 on even restarts, 2 on odd; ``--crash kill``: SIGKILL), so two rounds in a row never fail the
same way: the supervisor stops a run whose rounds fail alike twice before it saw a step as a configuration error,
and a step's telemetry reaches it up to half a second late, after this job's crash.

Each rank appends one JSON line to --record (``O_APPEND``: whole lines from every process) when it has completed
its first step of a round (``event: step``), just before it crashes (``crash``) and when it finished the job
(``finished``); each with the restart count, rank, pid, time, and ``warm``: whether the process was forked by
the warm workers' zygote (its parent runs ``trainwarden.runtime.zygote --serve``) rather than started cold.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

import trainwarden.runtime


def forked_warm() -> bool:
    """Whether this process's parent is the warm workers' zygote (its command line is ``... zygote --serve ...``)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return b"--serve" in argv and any(arg.endswith(b"runtime.zygote") for arg in argv)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--crashes", type=int, required=True, help="rounds that crash (then one that finishes)")
    p.add_argument("--record", required=True, help="the JSON lines file every rank appends to")
    p.add_argument("--crash", choices=("exit", "kill"), default="exit")
    p.add_argument("--crash-step", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="steps of the last round")
    p.add_argument("--sleep-ms", type=float, default=50.0, help="a wait inside every step")
    args = p.parse_args()

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    warm = forked_warm()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    record_fd = os.open(args.record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(event: str, **fields) -> None:
        line = {"event": event, "restart": restart, "rank": rank, "pid": os.getpid(), "warm": warm,
                "t": time.time(), **fields}
        os.write(record_fd, (json.dumps(line) + "\n").encode())

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rt = trainwarden.runtime.init(mesh={"dp": world})
    crashes_now = restart < args.crashes and rank == restart % world
    last = args.crash_step if restart < args.crashes else args.steps
    for step in range(1, last + 1):
        if crashes_now and step == args.crash_step:
            record("crash", how=args.crash, step=step)
            if args.crash == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(1 + restart % 2)
        with rt.step(step, tokens=8):
            time.sleep(args.sleep_ms / 1000)
            x = torch.randn(8, 32)
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if step == 1:
            record("step", step=step)
        print(f"crash_loop: restart {restart} rank {rank} step {step} {'warm' if warm else 'cold'}", flush=True)
    record("finished", step=last)
    rt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

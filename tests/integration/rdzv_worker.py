"""Tiny torchrun worker for the etcd3 rendezvous tests: gloo init, one all_reduce, print the result.

Each rank contributes ``rank + 1``; every rank must see ``world * (world + 1) / 2``. It prints one line
per rank, ``RESULT rank=R world=W restart=N sum=S ok=True|False``, which the tests parse.

``--crash-rank-1-first-round``: rank 1 SIGKILLs itself after the first all_reduce of restart round 0
(the previous round's gloo keys are then in the store), rank 0 blocks in a second all_reduce until
torchrun tears the round down; torchrun must bring both back in round 1. In round 1, rank 0 starts
late, so a store that still holds round 0's keys makes rank 1 fail deterministically.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--crash-rank-1-first-round", action="store_true")
    args = parser.parse_args()

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.crash_rank_1_first_round and restart > 0 and os.environ.get("RANK") == "0":
        # Let rank 1 look up rank 0's gloo address before rank 0 publishes this round's: with a store
        # shared across rounds it finds the previous round's address and gets "Connection refused".
        time.sleep(2.0)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    if args.crash_rank_1_first_round and restart == 0:
        if rank == 1:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(torch.zeros(1))  # blocks: rank 1 is gone; torchrun stops this worker
    expected = world * (world + 1) / 2
    line = f"RESULT rank={rank} world={world} restart={restart} sum={value.item():g} ok={value.item() == expected}\n"
    sys.stdout.write(line)  # one write per line: the ranks share torchrun's stdout
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What hashing a checkpoint's files while they are written costs (issue 48: under 5 % of a save's background time,
nothing of its stall).

One process, one Checkpointer, a state of ``--mb`` MiB of float32 tensors, saved ``--saves`` times with the hashing
file system (the product) and with DCP's plain one, alternating, in the same process; medians of the background time
(save to commit) and of the stall (what ``save`` blocks the training thread for), and the ratios.

    python tests/bench/bench_checkpoint_sums.py --mb 256 --saves 6
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import FileSystem

from trainwarden.agent.shared import checkpoint_layout as store
from trainwarden.agent.shared import checkpoint_sums
from trainwarden.runtime.checkpoint import checkpointer as checkpoint_module
from trainwarden.runtime.checkpoint import Checkpointer


def _plain_writer():
    """The product's writer with DCP's own file system: no hashing."""
    base = checkpoint_module._Writer

    class Plain(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.fs = FileSystem()

    return Plain


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="state size in MiB (default 256)")
    parser.add_argument("--saves", type=int, default=6, help="saves of each kind (default 6)")
    args = parser.parse_args(argv)
    n = args.mb * (1 << 20) // 4 // 8
    state = {"model": {f"w{i}": torch.randn(n) for i in range(8)}}
    hashed_writer, plain_writer = checkpoint_module._Writer, _plain_writer()
    times = {"hashed": ([], []), "plain": ([], [])}
    root = Path(tempfile.mkdtemp(prefix="tw-bench-sums-"))
    try:
        with Checkpointer(root, keep=1, memory_dir=False) as ckpt:
            for i in range(2 * args.saves + 2):
                kind = "hashed" if i % 2 == 0 else "plain"
                checkpoint_module._Writer = hashed_writer if kind == "hashed" else plain_writer
                ckpt.save(i + 1, state)
                ckpt.wait()
                if i >= 2:  # the first of each kind warms the stager's buffers and the page cache
                    times[kind][0].append(ckpt.last_save_seconds)
                    times[kind][1].append(ckpt.last_stall_seconds)
                print(f"\rsave {i + 1}/{2 * args.saves + 2}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        checkpoint_module._Writer = hashed_writer
        with Checkpointer(root, keep=1, memory_dir=False) as ckpt:
            ckpt.save(1000, state)
            ckpt.wait()
        began = time.perf_counter()
        assert not checkpoint_sums.verify(store.step_dir(root, 1000))
        verify_s = time.perf_counter() - began
        with Checkpointer(root, keep=1, memory_dir=False) as again:
            began = time.perf_counter()
            again.restore(state)
            restore_s = time.perf_counter() - began
    finally:
        checkpoint_module._Writer = hashed_writer
        shutil.rmtree(root, ignore_errors=True)
    med = {k: (statistics.median(v[0]), statistics.median(v[1])) for k, v in times.items()}
    print(f"state {args.mb} MiB, {args.saves} saves each, medians:")
    for kind in ("plain", "hashed"):
        print(f"  {kind:6s}  background {med[kind][0]:.3f}s  stall {med[kind][1]:.4f}s")
    print(f"restore (verify included) {restore_s:.3f}s, of which verifying {verify_s:.3f}s "
          f"({verify_s / restore_s:.0%}, files in the page cache)")
    print(f"hashing: background x{med['hashed'][0] / med['plain'][0]:.3f}, "
          f"stall x{med['hashed'][1] / med['plain'][1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

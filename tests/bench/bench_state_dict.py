"""Benchmark: the reference job's ``state_dict()`` through ``StateDictReader`` against torch's ``get_state_dict``.

Run under torchrun (8 ranks, gloo on CPU; the reference job's shape, pp2 x tp2 x dp2)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone \\
        --nproc-per-node 8 tests/bench/bench_state_dict.py

A memory snapshot after every step asks the job for its state dict every step (runtime/checkpoint/memory_snapshot.py).
After two training steps, every rank times ``--calls`` calls of each, alternating in ``--rounds`` rounds, all ranks
at once as in a job; it prints the slowest rank's mean per call for each round and the ratio of the medians, and
checks that both give the same keys and the same tensors (runtime/checkpoint/state_dict_reader.py compares them itself too).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict

sys.path.insert(0, str(Path(__file__).parent))
from bench_checkpoint import per_rank  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=64, help="model dim (the reference job: 64)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--calls", type=int, default=200, help="calls per round and way")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from trainwarden.runtime.examples.data import DataConfig, SyntheticData
    from trainwarden.runtime.examples.gpt import _SD_OPTIONS, TrainState
    from trainwarden.runtime.examples.model import ModelConfig
    from trainwarden.runtime.examples.parallel import MeshConfig, build_mesh, build_parallel_model, pick_device
    from trainwarden.runtime.checkpoint.state_dict_reader import _difference

    dist.init_process_group("gloo")
    if dist.get_world_size() != 8:
        raise SystemExit("run with 8 ranks (pp2 x tp2 x dp2)")
    device = pick_device(0)
    mesh_cfg = MeshConfig(dp=2, tp=2, pp=2, micro_batches=2)
    pm = build_parallel_model(ModelConfig(vocab=args.vocab, dim=args.width, heads=4, layers=args.layers, seq=64),
                              mesh_cfg, build_mesh(mesh_cfg, device), device, seed=0)
    optimizer = torch.optim.AdamW(pm.model.parameters(), lr=1e-3)
    data = SyntheticData(DataConfig(vocab=args.vocab, seq=64, batch=8, seed=0))
    state = TrainState(pm.model, optimizer)
    for index in range(2):
        pm.train_step(*data.batch(index, pm.dp_rank, 2))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    ways = {"get_state_dict": lambda: get_state_dict(pm.model, optimizer, options=_SD_OPTIONS),
            "StateDictReader": state._reader.read}
    same = _difference(ways["get_state_dict"](), ways["StateDictReader"]()) is None
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, read in ways.items():
            for _ in range(10):
                read()
            dist.barrier()
            began = time.perf_counter()
            for _ in range(args.calls):
                read()
            times[name].append(max(per_rank((time.perf_counter() - began) / args.calls)))
    fast_reads = state._reader.fast_reads
    all_same = all(bool(s) for s in per_rank(float(same)))
    if dist.get_rank() == 0:
        for name, rounds in times.items():
            print(f"{name}: {[round(t * 1e3, 2) for t in rounds]} ms per call (slowest rank, each round)")
        slow, fast = (statistics.median(times[n]) for n in ("get_state_dict", "StateDictReader"))
        print(f"StateDictReader / get_state_dict = {fast / slow:.2f} ({fast * 1e3:.2f} against {slow * 1e3:.2f} ms); "
              f"same keys and tensors on every rank: {all_same}; rank 0's reads the short way: {fast_reads}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

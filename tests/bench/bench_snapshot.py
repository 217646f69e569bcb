"""Benchmark: what a memory snapshot after every step costs the step, and restore from memory against disk.

Run under torchrun (8 ranks, gloo on CPU; the reference job's shape, pp2 x tp2 x dp2)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 python -m torch.distributed.run --standalone --nproc-per-node 8 \\
        tests/bench/bench_snapshot.py --width 64 --layers 4 --vocab 256 --blocks 6 --block-steps 8

``--ranks-per-node 4`` pretends the 8 ranks are two nodes: every snapshot is also copied to the other "node"
(runtime/checkpoint/memory_peer.py), so the "with snapshots" steps pay for the copies too. The defaults are the reference
job's own model (``runtime/examples/gpt.py``: dim 64, 4 layers, vocabulary 256);
``--width 512 --layers 8 --vocab 8192`` is a larger one. In one process, blocks of ``--block-steps`` training steps
alternate between "snapshot after every step" (``Checkpointer.snapshot``, written to a tmpfs directory as under
`trainwarden run`) and "no snapshot", so both see the same machine; a step's time is the slowest rank's, the
snapshot call included and the background part overlapping the next step as it does in a job. It prints the
median step of each, the ratio, the snapshot call's own time (the copy into the rank's mapped file, which the step
waits for) and the background write's (the header and the rename: the tensors are in the file already).

``--compare-sums``: the blocks alternate between snapshots whose tensors are hashed (XXH3-64 in the background
write, runtime/checkpoint/memory_sums.py: the product) and snapshots without sums, instead of "snapshot" and "no snapshot", and
it prints both modes' step, snapshot call (the stall) and background write.

Then it restores the same state from the newest snapshot and from a disk checkpoint (DCP, the same
``Checkpointer.restore``) and prints both. The node agent is not running here: the restore's question "which
steps of this rank does the agent hold" is answered from the files themselves.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from bench_checkpoint import per_rank  # noqa: E402

from trainwarden.agent.shared.snapshot_layout import rank_snapshots  # noqa: E402
from trainwarden.runtime.checkpoint import Checkpointer, RNGState  # noqa: E402


class _FilesAsAgent:
    """Answers the restore's questions as the node agent would, from the snapshot files (no agent runs here)."""

    def __init__(self, memory_dir: Path, world: int, rank: int, *, others: bool = False) -> None:
        self.memory_dir, self.world, self.rank, self.others = memory_dir, world, rank, others

    def memory_held(self, world_size: int) -> list[tuple[int, int, int]]:
        """This rank's files; with ``others``, every rank's but its own: no rank holds its own file, so the restore
        goes through DCP and each rank's own chunks come from another rank (runtime/checkpoint/memory_reshard.py)."""
        ranks = [r for r in range(self.world) if r != self.rank] if self.others else [self.rank]
        return [(world_size, r, step) for r in ranks for step, _ in rank_snapshots(self.memory_dir, world_size, r)]

    def committed_record(self):
        return None, "", "none recorded"

    def checkpoint_event(self, *args, **kwargs) -> None:
        pass

    def commit_refusal(self, *args, **kwargs):
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=64, help="model dim (the reference job: 64)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=6, help="blocks per mode (alternating)")
    ap.add_argument("--block-steps", type=int, default=8)
    ap.add_argument("--ranks-per-node", type=int, default=None,
                    help="pretend the ranks are on nodes of this many (e.g. 4): each snapshot is also copied to the "
                         "next 'node' (runtime/checkpoint/memory_peer.py), and its cost is in the step times")
    ap.add_argument("--shm", default="/dev/shm", help="the tmpfs the snapshots go to (as TRAINWARDEN_MEMORY_ROOT)")
    ap.add_argument("--compare-sums", action="store_true",
                    help="alternate snapshots with and without checksums (the step and the background write)")
    args = ap.parse_args()

    from trainwarden.runtime.examples.data import DataConfig, SyntheticData
    from trainwarden.runtime.examples.gpt import TrainState
    from trainwarden.runtime.examples.model import ModelConfig
    from trainwarden.runtime.examples.parallel import MeshConfig, build_mesh, build_parallel_model, pick_device

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 8:
        raise SystemExit("run with 8 ranks (pp2 x tp2 x dp2)")
    device = pick_device(int(os.environ.get("LOCAL_RANK", "0")))
    model_cfg = ModelConfig(vocab=args.vocab, dim=args.width, heads=4, layers=args.layers, seq=64)
    mesh_cfg = MeshConfig(dp=2, tp=2, pp=2, micro_batches=2)
    pm = build_parallel_model(model_cfg, mesh_cfg, build_mesh(mesh_cfg, device), device, seed=0)
    optim = torch.optim.AdamW(pm.model.parameters(), lr=1e-3)
    data = SyntheticData(DataConfig(vocab=args.vocab, seq=64, batch=8, seed=0))
    train_state = TrainState(pm.model, optim)
    state = {"app": train_state, "rng": RNGState()}

    box = [(tempfile.mkdtemp(prefix="tw-bench-snap-", dir=args.shm), tempfile.mkdtemp(prefix="tw-bench-snapdisk-"))
           if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    memory_dir, disk_dir = Path(box[0][0]), Path(box[0][1])
    ckpt = Checkpointer(disk_dir / "ckpt", memory_dir=memory_dir, session=_FilesAsAgent(memory_dir, world, rank),
                        ranks_per_node=args.ranks_per_node)

    def step(index: int) -> None:
        inputs, targets = data.batch(index, pm.dp_rank, 2)
        pm.train_step(inputs, targets)
        optim.step()
        optim.zero_grad(set_to_none=True)
        train_state.step = index

    index, first_calls = 0, []
    for _ in range(3):  # warm-up: allocations, the first snapshot's buffers
        index += 1
        step(index)
        call = time.monotonic()
        ckpt.snapshot(index, state)  # the first two make the rank's files (and record DCP's view of the state)
        first_calls.append(max(per_rank(time.monotonic() - call)))
        ckpt.memory.wait()
    times: dict[bool, list[float]] = {True: [], False: []}
    calls, writes, state_dicts = [], [], []
    by_sums: dict[bool, dict[str, list[float]]] = {m: {"calls": [], "writes": []} for m in (True, False)}
    for block in range(2 * args.blocks):
        mode = block % 2 == 0  # the first mode: with snapshots, or (--compare-sums) with sums
        snapshots = mode or args.compare_sums
        if args.compare_sums:
            ckpt.memory.wait()
            ckpt.memory.sums = mode
        for _ in range(args.block_steps):
            index += 1
            dist.barrier()
            began = time.monotonic()
            step(index)
            if snapshots:
                call = time.monotonic()
                ckpt.snapshot(index, state)
                calls.append(time.monotonic() - call)
                by_sums[mode]["calls"].append(calls[-1])
            times[mode].append(max(per_rank(time.monotonic() - began)))
            if snapshots:
                call = time.monotonic()
                train_state.state_dict()
                state_dicts.append(time.monotonic() - call)
        if snapshots:
            if args.compare_sums:
                ckpt.memory.wait()  # the block's last write is finished (and its time taken) before the mode changes
            writes.append(ckpt.memory.last_write_seconds)
            by_sums[mode]["writes"].append(max(per_rank(ckpt.memory.last_write_seconds)))
    ckpt.memory.sums = True
    ckpt.memory.wait()
    view_began = time.monotonic()  # what the first snapshot into a new file adds: DCP's view of the state
    ckpt.memory._dcp_view({name: entry.state_dict() if hasattr(entry, "state_dict") else entry
                           for name, entry in state.items()})
    view_s = max(per_rank(time.monotonic() - view_began))
    copied = (ckpt.peer.sent, ckpt.peer.received) if ckpt.peer is not None else None
    last = ckpt.memory.last_step
    skipped = ckpt.memory.skipped
    ckpt.save(last, state)  # the same step on disk, for the restore comparison
    ckpt.wait()
    nbytes = sum(p.stat().st_size for p in memory_dir.glob("world-*/*.pt")) / 2  # two kept per rank (not the copies)
    ckpt.close()

    restores: dict[str, list] = {"memory": [], "disk": [], "memory-dcp": []}
    for source in ("memory", "disk", "memory-dcp") * 3:  # alternating: none gets the one-time costs alone
        ck = Checkpointer(disk_dir / "ckpt", memory_dir=memory_dir if source != "disk" else None,
                          session=_FilesAsAgent(memory_dir, world, rank, others=source == "memory-dcp"),
                          read_backoff_s=())
        dist.barrier()
        began = time.monotonic()
        restored = ck.restore(state)
        restores[source].append((max(per_rank(time.monotonic() - began)), restored, ck.resumed_from_memory))
        ck.close()
    skipped_all = sum(int(s) for s in per_rank(float(skipped)))

    if rank == 0:
        with_s, without = statistics.median(times[True]), statistics.median(times[False])
        print(f"model dim={args.width} layers={args.layers} vocab={args.vocab}, world={world} (pp2 x tp2 x dp2); "
              f"snapshot of one step: {nbytes / 2**20:.2f} MiB on this node (all ranks)")
        if args.compare_sums:
            on, off = by_sums[True], by_sums[False]
            w_on, w_off = statistics.median(on["writes"]), statistics.median(off["writes"])
            c_on, c_off = statistics.median(on["calls"]), statistics.median(off["calls"])
            print(f"checksums, a snapshot every step: step median {with_s * 1e3:.1f} ms with sums, "
                  f"{without * 1e3:.1f} ms without (ratio {with_s / without:.3f}); snapshot call on rank 0 (the "
                  f"stall) {c_on * 1e3:.2f} ms with, {c_off * 1e3:.2f} ms without (ratio {c_on / c_off:.3f}); "
                  f"background write (slowest rank, last of each block) {w_on * 1e3:.2f} ms with, "
                  f"{w_off * 1e3:.2f} ms without (ratio {w_on / w_off:.3f}; +{(w_on - w_off) * 1e3:.2f} ms)")
        else:
            print(f"step with a snapshot every step: median {with_s * 1e3:.1f} ms over {len(times[True])} steps; "
                  f"without: {without * 1e3:.1f} ms over {len(times[False])} steps")
            print(f"ratio with/without = {with_s / without:.3f} (overhead {100 * (with_s / without - 1):+.1f} %)")
        print(f"snapshot call on rank 0 (the copy the step waits for): median {statistics.median(calls) * 1e3:.2f} ms; "
              f"of it TrainState.state_dict() alone (measured after it, outside the step's time) "
              f"{statistics.median(state_dicts) * 1e3:.2f} ms; background write (last per block): median {statistics.median(writes) * 1e3:.2f} ms; "
              f"skipped (a write still in flight): {skipped_all} of {len(times[True]) * world} rank-steps")
        mem, disk, via_dcp = (statistics.median(r[0] for r in restores[k]) for k in ("memory", "disk", "memory-dcp"))
        print(f"restore of step {last} (median of 3, alternating): from memory {mem * 1e3:.0f} ms "
              f"{[(round(r[0] * 1e3), r[1], r[2]) for r in restores['memory']]}, from disk {disk * 1e3:.0f} ms "
              f"{[(round(r[0] * 1e3), r[1], r[2]) for r in restores['disk']]}; ratio {mem / disk:.2f}")
        print(f"restore of step {last} from memory through DCP, every rank's chunks from another rank's file (a new "
              f"numbering; exchanged over gloo): {via_dcp * 1e3:.0f} ms "
              f"{[(round(r[0] * 1e3), r[1], r[2]) for r in restores['memory-dcp']]}; ratio to disk {via_dcp / disk:.2f}")
        if copied is not None:
            print(f"peer copies (nodes of {args.ranks_per_node} ranks): rank 0 sent {copied[0]} and received "
                  f"{copied[1]} files")
        print(f"first snapshot calls (the first two make the files and record DCP's view; the third reuses): "
              f"{[round(t * 1e3, 1) for t in first_calls]} ms; of a new file's, DCP's view of the state (state_dict() "
              f"included) {view_s * 1e3:.1f} ms")
        shutil.rmtree(memory_dir, ignore_errors=True)
        shutil.rmtree(disk_dir, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

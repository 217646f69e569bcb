"""What the numeric guard costs a training step (issue 48: watching under 0.25 % of the training thread).

Runs the reference job's model (runtime/examples/parallel.py, the demo's shape unless told otherwise) under torchrun with gloo
on CPU, ``--ranks`` processes, and trains rounds of ``--steps`` steps alternately with the guard between backward and
the optimizer step and without it, in the same processes. Prints, per kind, the median step time over the rounds, the
guard's own time per step (its norms, one collective of three integers and the read of the result), and the shares:

    guard's time / step time        what the guard takes of the training thread; its collective also waits for the
                                    slowest rank, a wait the step's next collective would otherwise have
                                    (``--synced`` puts a barrier before it, in both kinds, to leave that wait out)
    step time with / without        the cost measured from outside (noisier on a shared machine)

    python tests/bench/bench_numeric.py --ranks 4 --steps 40 --rounds 3 [--synced]

``--watch`` instead measures auto-instrumentation's gradient watch (``GradientWatch``, detection only, for unchanged
scripts) in this one process: its two hook calls per step on models of 0.1, 1 and 10 million parameters (16 tensors),
against the optimizer step (SGD) they surround, on the CPU.

    python tests/bench/bench_numeric.py --watch
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _worker(args) -> None:
    import torch
    import torch.distributed as dist

    from trainwarden.runtime.examples.data import DataConfig, SyntheticData
    from trainwarden.runtime.examples.model import ModelConfig
    from trainwarden.runtime.numeric import NumericGuard
    from trainwarden.runtime.examples.parallel import MeshConfig, build_mesh, build_parallel_model

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    model_cfg = ModelConfig(vocab=256, dim=args.dim, heads=4, layers=4, seq=64)
    mesh_cfg = MeshConfig(dp=world // (args.tp * args.pp), tp=args.tp, pp=args.pp, micro_batches=2)
    device = torch.device("cpu")
    mesh = build_mesh(mesh_cfg, device)
    batch = 4 * mesh_cfg.dp * mesh_cfg.micro_batches
    pm = build_parallel_model(model_cfg, mesh_cfg, mesh, device, seed=0,
                              micro_batch=batch // (mesh_cfg.dp * mesh_cfg.micro_batches))
    optimizer = torch.optim.AdamW(pm.model.parameters(), lr=1e-3)
    data = SyntheticData(DataConfig(vocab=256, seq=64, batch=batch, seed=0))
    guard = NumericGuard(None, policy="rollback")
    results = {"guarded": {"step": [], "guard": []}, "plain": {"step": [], "guard": []}}
    step = 0
    for r in range(2 * args.rounds + 2):
        kind = "guarded" if r % 2 == 0 else "plain"
        steps, guarded = [], 0.0
        for _ in range(args.steps):
            step += 1
            began = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            inputs, targets = data.batch(step, pm.dp_rank, mesh_cfg.dp)
            pm.train_step(inputs, targets)
            if args.synced:
                dist.barrier()  # the ranks' skew out of the guard's time: what is left is its own work
            if kind == "guarded":
                g0 = time.perf_counter()
                applied = guard.check(step, loss=pm.local_loss, parameters=pm.model.parameters())
                guarded += time.perf_counter() - g0
            else:
                applied = True
            if applied:
                optimizer.step()
            steps.append(time.perf_counter() - began)
        if r >= 2:  # the first round of each kind warms up
            results[kind]["step"].append(statistics.median(steps))
            results[kind]["guard"].append(guarded / args.steps)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def _watch() -> int:
    import torch

    from trainwarden.runtime.numeric import GradientWatch

    torch.set_num_threads(1)
    print("gradient watch (before_step + after_step) against SGD's step, one CPU thread:")
    for params in (100_000, 1_000_000, 10_000_000):
        side = int((params / 16) ** 0.5)
        model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(side, side)) for _ in range(16)])
        for p in model:
            p.grad = torch.randn_like(p)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
        watch = GradientWatch(lambda step, detail: None)
        rounds = max(20, 20_000_000 // params)

        def timed(fn) -> float:
            samples = []
            for _ in range(5):
                began = time.perf_counter()
                for i in range(rounds):
                    fn(i)
                samples.append((time.perf_counter() - began) / rounds)
            return statistics.median(samples)

        def watched(i):
            watch.before_step(optimizer)
            watch.after_step(i)

        cost, step = timed(watched), timed(lambda i: optimizer.step())
        print(f"  {16 * side * side / 1e6:5.1f} M parameters: watch {cost * 1e6:8.0f} us, SGD step {step * 1e6:8.0f} us, "
              f"ratio {cost / step:.3f}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="steps per round (default 40)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each kind (default 3)")
    parser.add_argument("--synced", action="store_true",
                        help="a barrier before the guard (in both kinds): its time is then its own work, not the wait "
                             "for the slowest rank that its collective absorbs (which the next collective would)")
    parser.add_argument("--watch", action="store_true", help="measure the gradient watch of unchanged scripts instead")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    if args.watch:
        return _watch()
    with tempfile.TemporaryDirectory(prefix="tw-bench-numeric-") as tmp:
        out = os.path.join(tmp, "result.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
               "--log-dir", os.path.join(tmp, "logs"), os.path.abspath(__file__), "--worker", "--out", out,
               "--tp", str(args.tp), "--pp", str(args.pp), "--dim", str(args.dim), "--steps", str(args.steps),
               "--rounds", str(args.rounds), *(["--synced"] if args.synced else [])]
        print(f"bench_numeric: {args.ranks} ranks (tp {args.tp}, pp {args.pp}, dim {args.dim}), "
              f"{args.rounds} rounds of {args.steps} steps each way{', a barrier before the guard' if args.synced else ''}",
              flush=True)
        done = subprocess.run(cmd, env=env, start_new_session=True)
        if done.returncode != 0:
            print(f"bench_numeric: torchrun failed (exit {done.returncode})", file=sys.stderr)
            return 1
        with open(out) as f:
            results = json.load(f)
    step_on = statistics.median(results["guarded"]["step"])
    step_off = statistics.median(results["plain"]["step"])
    guard = statistics.median(results["guarded"]["guard"])
    print(f"step (median of rounds' medians): guarded {step_on * 1e3:.2f} ms, plain {step_off * 1e3:.2f} ms, "
          f"ratio {step_on / step_off:.4f}")
    print(f"guard per step: {guard * 1e6:.0f} us = {100 * guard / step_on:.3f} % of the guarded step "
          f"(rounds: {', '.join(f'{g * 1e6:.0f}' for g in results['guarded']['guard'])} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How far the soak's loss may drift after a shrink with nothing wrong (issue 45: the final loss's tolerance).

After the world changes size, the soak (tests/bench/soak.py) compares the mean loss of the last 100 steps with the
fault-free run's, within ``_soak_plan.LOSS_TAIL_TOLERANCE``. This script measures what that mean does when the only
difference is the order in which the same samples' gradients are summed, which is all an exact resume at another
data-parallel degree changes. It trains the soak job's model, data and optimizer (runtime/examples/gpt.py with the
soak's flags but one pipeline stage and no tensor parallelism, so that a run takes minutes, not an hour) under torchrun
with gloo on CPU:

    base        one rank, micro-batches of 2 sequences (4 accumulated a step), from step 1 to ``--steps``;
                checkpointed at ``--switch``;
    variants    from that checkpoint to ``--steps``, each summing the same global batch of 8 in another order:
                micro-batches of 1 (8 accumulated), of 4 (2 accumulated) and of 8 (one), and two data-parallel
                ranks of 2 micro-batches of 2 each.

It prints, for every pair of runs, the relative difference of their last-100-step mean losses, and the largest of them
against the soak's tolerance. Fault-free trajectories that differ only by rounding spread this much; a soak run
outside the tolerance is then a resume that was not exact, not noise.

    python tests/bench/soak_loss_spread.py --steps 2400 --switch 356 [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _procs import run_in_session  # noqa: E402
from _soak_plan import LOSS_TAIL_STEPS, LOSS_TAIL_TOLERANCE, tail_mean  # noqa: E402

STEP = re.compile(r"\] [\w.]+: step (\d+) loss (\S+) time", re.M)
MODEL = ["--tp", "1", "--pp", "1", "--batch", "8"]
"""The soak's job (tests/bench/_soak_job.py) but its 2 x 2 model parallelism: same model, data, lr and batch."""
VARIANTS = {"mb1": (1, ["--micro-batch-size", "1"]), "mb4": (1, ["--micro-batch-size", "4"]),
            "mb8": (1, ["--micro-batch-size", "8"]), "dp2": (2, ["--micro-batch-size", "2"])}
"""name: (ranks, flags) of the runs that continue from the base run's checkpoint at ``--switch``. Not two ranks of
one micro-batch of 4: it sums the same two partial gradients as mb4, and its losses equal mb4's bit for bit."""


def _train(work: Path, name: str, ranks: int, flags: list[str], steps: int, ckpt: Path, every: int) -> dict[int, float]:
    log = work / f"{name}.log"
    if log.exists() and f"done steps={steps} " in log.read_text(errors="replace"):  # a kept run (--keep)
        return {int(s): float(loss) for s, loss in STEP.findall(log.read_text(errors="replace"))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "-m", "trainwarden.runtime.examples.gpt", *MODEL, *flags, "--steps", str(steps),
           "--ckpt-dir", str(ckpt), "--ckpt-every", str(every), "--keep", "1"]
    tmp = work / "tmp" / name  # torchrun's own log directory (torchelastic_*) goes here, removed with the work
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TMPDIR=str(tmp))
    rc = run_in_session(cmd, env=env, log=log, timeout=steps * 2.0 + 300)
    text = log.read_text(errors="replace")
    if rc != 0:
        raise SystemExit(f"run {name} exited {rc}; its log ({log}) ends:\n{text[-3000:]}")
    return {int(s): float(loss) for s, loss in STEP.findall(text)}


def _tail_mean(name: str, losses: dict[int, float], last: int) -> float:
    missing = [s for s in range(last - LOSS_TAIL_STEPS + 1, last + 1) if s not in losses]
    if missing:
        raise SystemExit(f"steps {missing[:5]}... missing from run {name}'s log")
    return tail_mean(losses, last)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2400, help="last step (the soak's hour: 2400)")
    p.add_argument("--switch", type=int, default=356, help="the step the variants start from (the hour's first "
                   "shrink, seed 46: 356)")
    p.add_argument("--parallel", type=int, default=2, help="variants trained at once")
    p.add_argument("--keep", metavar="DIR", help="keep the runs' logs and checkpoints in DIR; a run DIR already "
                   "holds a finished log of is read, not trained again")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line too")
    args = p.parse_args(argv)
    if not 0 < args.switch < args.steps - LOSS_TAIL_STEPS:
        p.error(f"--switch must be above 0 and below --steps - {LOSS_TAIL_STEPS}")
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tw-loss-spread-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        print(f"base: steps 1-{args.switch}, checkpoint at {args.switch}", flush=True)
        base_ckpt = work / "ckpt-base"
        first = _train(work, "base-1", 1, ["--micro-batch-size", "2"], args.switch, base_ckpt, args.switch)
        runs = {"mb2": (1, ["--micro-batch-size", "2"]), **VARIANTS}
        for name in runs:
            if not (work / f"ckpt-{name}").exists():
                shutil.copytree(base_ckpt, work / f"ckpt-{name}")

        def cont(name: str) -> tuple[str, dict[int, float]]:
            ranks, flags = runs[name]
            losses = _train(work, name, ranks, flags, args.steps, work / f"ckpt-{name}", args.steps * 10)
            print(f"  {name}: steps {min(losses)}-{max(losses)} in {time.monotonic() - started:.0f} s", flush=True)
            return name, {**first, **losses}

        print(f"runs from step {args.switch + 1} to {args.steps}: {', '.join(runs)} ({args.parallel} at once)",
              flush=True)
        with ThreadPoolExecutor(args.parallel) as pool:
            losses = dict(pool.map(cont, runs))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    means = {name: _tail_mean(name, run, args.steps) for name, run in losses.items()}
    pairs = {f"{a}/{b}": abs(means[a] - means[b]) / means[b] for a, b in itertools.combinations(means, 2)}
    first_diff = {name: next((s for s in sorted(run) if run[s] != losses["mb2"][s]), None)
                  for name, run in losses.items() if name != "mb2"}
    print(f"mean loss of the last {LOSS_TAIL_STEPS} steps: "
          + ", ".join(f"{n} {m:.6f}" for n, m in means.items()))
    print("first step logged differently from mb2: " + ", ".join(f"{n} {s}" for n, s in first_diff.items()))
    for pair, rel in pairs.items():
        print(f"  {pair}: {rel:.2%}")
    worst = max(pairs.values())
    spread = statistics.stdev(means.values()) / statistics.mean(means.values())
    print(f"the runs' last-{LOSS_TAIL_STEPS}-step means: standard deviation {spread:.2%} of their mean; a pair's "
          f"difference then has one of {spread * 2 ** 0.5:.2%}")
    print(f"loss spread: largest {worst:.2%} of {len(pairs)} pairs, median "
          f"{sorted(pairs.values())[len(pairs) // 2]:.2%}; the soak's tolerance {LOSS_TAIL_TOLERANCE:.0%} "
          f"(largest / tolerance = {worst / LOSS_TAIL_TOLERANCE:.2f}) in {time.monotonic() - started:.0f} s")
    if args.json:
        print(json.dumps({"steps": args.steps, "switch": args.switch, "means": means, "pairs": pairs,
                          "first_diff": first_diff, "sd": spread, "tolerance": LOSS_TAIL_TOLERANCE}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

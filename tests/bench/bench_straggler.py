"""Benchmark: straggler detection, steps to flag and to clear per slowdown factor, and false flags.

    python tests/bench/bench_straggler.py [--factors 1.1,1.2,1.5,2.0] [--clean-steps 300] [--nproc 4]

Every run trains the reference job under `trainwarden run` (its in-process agent and watchdog) on CPU
with gloo, dp 2 x tp 2 on 4 ranks (`--pp 2` with `--nproc 8` for the 3-D mesh), a checkpoint every 20
steps. Slowdown runs inject `slow:rank=1,from=20,until=70,factor=F` (rank 1 waits (F - 1) x its previous
step before every step from 20 to 69) and run 100 steps; the clean run has no fault.

* steps to flag  = the job's latest step when the `straggler_start` incident was recorded - 20
* steps to clear = the job's latest step at `straggler_end` - 70
* false flags    = straggler incidents naming another rank (slowdown runs) or any rank (clean run)

The baseline is the clean run of the same job in the same script: it is what "no straggler" looks like
on this machine, and its flags are the false-positive count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _procs import run_in_session

SLOW_FROM, SLOW_UNTIL, SLOW_RANK = 20, 70, 1


def _gpt(nproc: int, steps: int) -> list[str]:
    mesh = ["--dp", "2", "--tp", "2", "--pp", "2" if nproc == 8 else "1"]
    return ["-m", "trainwarden.runtime.examples.gpt", *mesh, "--steps", str(steps), "--ckpt-every", "20"]


def _run_job(root: Path, job: str, faults: str, nproc: int, steps: int, timeout: float) -> tuple[int | None, list]:
    env = dict(os.environ, TRAINWARDEN_STATE_HOME=str(root), TRAINWARDEN_FAULTS=faults)
    cmd = [sys.executable, "-m", "trainwarden.agent.cli", "run", "--nproc-per-node", str(nproc), "--job", job,
           "--metrics-port", "0", "--monitor-interval", "0.5", "--", *_gpt(nproc, steps)]
    rc = run_in_session(cmd, env=env, log=root / f"{job}.log", timeout=timeout)
    directory = root / "jobs" / job / "incidents"
    found = [json.loads(p.read_text()) for p in directory.glob("*.json")] if directory.exists() else []
    return rc, sorted((i for i in found if i["kind"].startswith("straggler")), key=lambda i: i["detected_at"])


def slowdown(root: Path, factor: float, nproc: int) -> dict:
    job = f"slow{str(factor).replace('.', '_')}"
    fault = f"slow:rank={SLOW_RANK},from={SLOW_FROM},until={SLOW_UNTIL},factor={factor}"
    started = time.monotonic()
    rc, found = _run_job(root, job, fault, nproc, 100, 600)
    ours = [i for i in found if i["ranks"] == [SLOW_RANK]]
    start = next((i for i in ours if i["kind"] == "straggler_start"), None)
    end = next((i for i in ours if i["kind"] == "straggler_end"), None)
    return {"factor": factor, "rc": rc, "wall_s": round(time.monotonic() - started, 1),
            "steps_to_flag": start["evidence"]["step"] - SLOW_FROM if start else None,
            "score": start["evidence"]["score"] if start else None,
            "steps_to_clear": end["evidence"]["step"] - SLOW_UNTIL if end else None,
            "false_flags": sum(1 for i in found if i["kind"] == "straggler_start" and i["ranks"] != [SLOW_RANK])}


def clean(root: Path, steps: int, nproc: int) -> dict:
    started = time.monotonic()
    rc, found = _run_job(root, "clean", "", nproc, steps, 900)
    return {"rc": rc, "steps": steps, "wall_s": round(time.monotonic() - started, 1),
            "false_flags": sum(1 for i in found if i["kind"] == "straggler_start"),
            "flagged": [(i["ranks"], i["evidence"].get("step"), i["evidence"].get("score"))
                        for i in found if i["kind"] == "straggler_start"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--factors", default="1.1,1.2,1.5,2.0", help="comma-separated slowdown factors")
    ap.add_argument("--clean-steps", type=int, default=300, help="steps of the clean run (0: skip it)")
    ap.add_argument("--nproc", type=int, default=4, choices=[4, 8])
    ap.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = ap.parse_args()
    factors = [float(f) for f in args.factors.split(",") if f]
    root = Path(tempfile.mkdtemp(prefix="tw-bench-straggler-"))
    results = []
    try:
        for factor in factors:
            print(f"running factor {factor} ...", file=sys.stderr, flush=True)
            results.append(slowdown(root, factor, args.nproc))
        print(f"running the clean baseline ({args.clean_steps} steps) ...", file=sys.stderr, flush=True)
        baseline = clean(root, args.clean_steps, args.nproc) if args.clean_steps else None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"reference job, {args.nproc} CPU ranks (gloo), slow rank {SLOW_RANK} from step {SLOW_FROM} "
          f"until {SLOW_UNTIL}; goal: 1.2x flagged within 30 steps, no false flags")
    print(f"{'factor':>6}  {'steps to flag':>13}  {'score':>6}  {'steps to clear':>14}  {'false flags':>11}  rc")
    for r in results:
        flag = "never" if r["steps_to_flag"] is None else str(r["steps_to_flag"])
        clear = "never" if r["steps_to_clear"] is None else str(r["steps_to_clear"])
        score = "-" if r["score"] is None else f"{r['score']:.2f}"
        print(f"{r['factor']:>6}  {flag:>13}  {score:>6}  {clear:>14}  {r['false_flags']:>11}  {r['rc']}")
    if baseline is not None:
        print(f"clean run, {baseline['steps']} steps: {baseline['false_flags']} false flags {baseline['flagged']}, "
              f"rc={baseline['rc']}")
    if args.json:
        print(json.dumps({"slowdowns": results, "clean": baseline}, indent=1))


if __name__ == "__main__":
    main()

"""Benchmark: the four fault kinds side by side, `trainwarden run` on its defaults vs plain torchrun, in one run.

    python tests/bench/bench_recovery.py [--bound 60] [--only crash,hang,kill,partition] [--json]

Each fault runs the scenario of its own benchmark, imported from it (the same job, fault, timings and parsing):

  crash      bench_restart.py: the reference job (8 CPU ranks, pp2 x tp2 x dp2), rank 5 SIGKILLs itself at step 16;
             `trainwarden run` with no flags (warm workers, memory snapshots) against `torchrun --standalone`
  hang       bench_hang.py: the same job, rank 2 blocks forever at step 15
  kill       bench_node_loss.py (root: the multi-host test bed): 3 nodes of 2 ranks, node n2 powered off at step 12;
             `trainwarden run` on each node against plain torchrun with its c10d store on a survivor
  partition  the same, n2's link down

Printed per fault, in seconds after the fault: when it was detected, when the job restored, and when it trained
again (the first step completed after the fault), for both launchers, and two ratios: against plain torchrun's
recovery from the same fault, and against plain torchrun's recovery from a crash in this run (the issue's goals
are stated against the latter). What plain torchrun cannot recover from by itself is charged at what it really
costs it: a hang and a partition leave its ranks waiting in a gloo collective until the collective timeout (1800 s
by default), so a run without progress within ``--bound`` seconds is charged 1800 s, marked as such.

Do not run beside other heavy work: the ranks are CPU-bound and the start-up phases measure the cores there are.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import bench_hang
import bench_node_loss
import bench_restart

GLOO_TIMEOUT_S = 1800.0
FAULTS = ("crash", "hang", "kill", "partition")


def crash(work: Path, bound: float) -> dict:
    rows = {}
    for launcher in ("trainwarden-warm", "torchrun"):
        (work / launcher).mkdir()
        row = bench_restart.run_once(launcher, 8, work / launcher)
        rows[launcher] = {"detect": row.get("detected"), "restore": row.get("restored"),
                          "train": row.get("first_step"), "note": row.get("error", "")}
    return {"trainwarden": rows["trainwarden-warm"], "torchrun": rows["torchrun"]}


def hang(work: Path, bound: float) -> dict:
    tw = bench_hang.trainwarden(work, 8, bound, warm=True)
    plain = bench_hang.plain_torchrun(work, 8, bound)
    tw_row = {"detect": tw["detected_s"], "restore": tw["restored_s"], "train": tw["recovered_s"],
              "note": f"deadline {tw['deadline_s']} s ({tw['deadline']})"}
    if plain["progress_after_fault_s"] is None:
        plain_row = {"detect": None, "restore": None, "train": GLOO_TIMEOUT_S, "charged": True,
                     "note": f"no progress within {bound:.0f} s: waits for gloo's collective timeout"}
    else:
        plain_row = {"detect": None, "restore": None, "train": plain["progress_after_fault_s"], "note": ""}
    return {"trainwarden": tw_row, "torchrun": plain_row}


def node_loss(kind: str, work: Path, bound: float) -> dict:
    out = {}
    for launcher, scenario in (("trainwarden", f"tw-{kind}-warm"), ("torchrun", f"torchrun-{kind}")):
        (work / scenario).mkdir()
        row = bench_node_loss.run_scenario(scenario, bound, work / scenario)
        entry = {"detect": row.get("detect_s"), "restore": row.get("restore_s"), "train": row.get("step_s"),
                 "note": row.get("note", "")}
        if entry["train"] is None and launcher == "torchrun" and kind == "partition":
            entry.update(train=GLOO_TIMEOUT_S, charged=True,
                         note=f"no progress within {bound:.0f} s: the survivors wait in a gloo collective")
        out[launcher] = entry
    return out


def _fmt(value, charged: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}*" if charged else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bound", type=float, default=60.0, help="seconds after the fault before a run counts as "
                   "not training again (plain torchrun's hang and partition; default 60)")
    p.add_argument("--only", default=",".join(FAULTS), help="comma-separated faults (default: all four)")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    args = p.parse_args(argv)
    faults = [f for f in args.only.split(",") if f]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        p.error(f"unknown fault(s) {unknown}; choose from {', '.join(FAULTS)}")
    if {"kill", "partition"} & set(faults):
        reason = bench_node_loss.TestBed.unavailable()
        if reason:
            print(f"bench_recovery: kill and partition need the test bed: {reason}", file=sys.stderr)
            return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: benches and the bed tear down
    results: dict[str, dict] = {}
    work = Path(tempfile.mkdtemp(prefix="tw-bench-recovery-"))
    try:
        for fault in faults:
            print(f"[{fault}] ...", file=sys.stderr, flush=True)
            where = work / fault
            where.mkdir()
            if fault == "crash":
                results[fault] = crash(where, args.bound)
            elif fault == "hang":
                results[fault] = hang(where, args.bound)
            else:
                results[fault] = node_loss(fault, where, args.bound)
            print(f"[{fault}] {results[fault]}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    base = results.get("crash", {}).get("torchrun", {}).get("train")
    print(f"\nseconds after the fault (detected / restored / training again); load average now "
          f"{os.getloadavg()[0]:.1f}; * = charged at gloo's collective timeout (no progress within {args.bound:.0f} s)\n")
    print(f"{'fault':10} {'trainwarden run (defaults)':>28} {'plain torchrun':>22} {'tw/torchrun':>12} "
          f"{'tw/torchrun crash':>18}")
    for fault, row in results.items():
        tw, plain = row["trainwarden"], row["torchrun"]
        tw_cols = f"{_fmt(tw['detect'])} / {_fmt(tw['restore'])} / {_fmt(tw['train'])}"
        plain_cols = f"{_fmt(plain['detect'])} / {_fmt(plain['restore'])} / " \
                     f"{_fmt(plain['train'], plain.get('charged', False))}"
        same = f"{tw['train'] / plain['train']:.2f}" if tw["train"] and plain["train"] else "-"
        vs_crash = f"{tw['train'] / base:.2f}" if tw["train"] and base else "-"
        print(f"{fault:10} {tw_cols:>28} {plain_cols:>22} {same:>12} {vs_crash:>18}")
        notes = "; ".join(n for n in (tw.get("note"), plain.get("note")) if n)
        if notes:
            print(f"{'':10} {notes}")
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())

"""Benchmark: hang detection latency and recovery time, trainwarden vs plain torchrun, same job and fault.

    python tests/bench/bench_hang.py [--bound 120] [--nproc 8]

Both runs train the reference job (pp2 x tp2 x dp2 on 8 CPU ranks, gloo) with `hang:rank=2,step=15`
(rank 2 blocks forever at the start of step 15; its peers wait inside that step's first collective).

* trainwarden: `trainwarden run` with its in-process agent. Detection latency = the fault's marker
  timestamp (written just before the rank blocks) -> the hang incident's `detected_at`; recovery = fault ->
  the first step completed after the restart (from the log's timestamps).
* plain torchrun: `torchrun --standalone` with the same environment; it has no hang detection, so it waits
  for gloo's collective timeout (30 min by default). The run is cut off at `--bound` seconds after the fault
  and reported as such.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _procs import stop_group

STEP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*\bstep (\d+) loss ")
RESUMED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*\bresumed from checkpoint step ", re.M)
FAULT = "hang:rank=2,step=15"
GPT = ["-m", "trainwarden.runtime.examples.gpt", "--dp", "2", "--tp", "2", "--pp", "2", "--steps", "30",
       "--ckpt-every", "5"]


def _stamp(text: str) -> float:
    return dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _fault_time(state_dir: Path) -> float | None:
    markers = list((state_dir / "faults").glob("fired-*"))
    return float(markers[0].read_text().split()[0]) if markers else None


def _first_step_after(log: str, after: float, min_step: int = 1) -> float | None:
    for line in log.splitlines():
        m = STEP.match(line)
        if m and _stamp(m.group(1)) > after and int(m.group(2)) >= min_step:
            return _stamp(m.group(1))
    return None


def _run(cmd: list[str], env: dict, log_path: Path, deadline_s: float, state_dir: Path, bound: float) -> int | None:
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    start = time.monotonic()
    try:
        while proc.poll() is None and time.monotonic() - start < deadline_s:
            fired = _fault_time(state_dir)
            if fired is not None and time.time() - fired > bound:
                break
            time.sleep(0.5)
        return proc.poll()
    finally:
        stop_group(proc)


def trainwarden(root: Path, nproc: int, bound: float, warm: bool = False) -> dict:
    home = root / ("tw-warm" if warm else "tw")
    env = dict(os.environ, TRAINWARDEN_STATE_HOME=str(home), TRAINWARDEN_FAULTS=FAULT)
    state = home / "jobs" / "benchhang"
    cmd = [sys.executable, "-m", "trainwarden.agent.cli", "run", "--nproc-per-node", str(nproc), "--job",
           "benchhang", "--metrics-port", "0",
           *(["--warm-workers"] if warm else ["--cold-workers"]), "--", *GPT]
    log_path = home.with_suffix(".log")
    rc = _run(cmd, env, log_path, 600, state, bound)
    fired = _fault_time(state)
    hangs = [json.loads(p.read_text()) for p in (state / "incidents").glob("*.json")]
    hangs = [h for h in hangs if h["kind"] == "hang"]
    log = log_path.read_text(errors="replace")
    resumed = log.find("resumed from checkpoint")
    recovered = _first_step_after(log[resumed:], fired) if fired and resumed >= 0 else None
    restored = next((_stamp(m.group(1)) for m in RESUMED.finditer(log) if fired and _stamp(m.group(1)) > fired), None)
    return {"rc": rc, "fault_at": fired, "detected_s": hangs[0]["detected_at"] - fired if hangs and fired else None,
            "culprits": hangs[0]["ranks"] if hangs else None,
            # the deadline that applied: the detection latency is about this plus the watchdog's period
            "deadline_s": hangs[0]["evidence"].get("timeout_seconds") if hangs else None,
            "deadline": hangs[0]["evidence"].get("deadline") if hangs else None,
            "restored_s": restored - fired if restored and fired else None,
            "recovered_s": recovered - fired if recovered and fired else None}


def plain_torchrun(root: Path, nproc: int, bound: float) -> dict:
    state = root / "plain"
    env = dict(os.environ, TRAINWARDEN_STATE_DIR=str(state), TRAINWARDEN_FAULTS=FAULT,
               TRAINWARDEN_CHECKPOINT_DIR=str(state / "ckpt"), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env.pop("TRAINWARDEN_AGENT_SOCKET", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", "2", *GPT]
    rc = _run(cmd, env, root / "plain.log", bound + 300, state, bound)
    fired = _fault_time(state)
    log = (root / "plain.log").read_text(errors="replace")
    after = _first_step_after(log, fired, min_step=15) if fired else None
    return {"rc": rc, "fault_at": fired, "progress_after_fault_s": after - fired if after and fired else None,
            "cut_off_after_s": bound}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bound", type=float, default=120.0, help="seconds after the fault to give plain torchrun")
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--warm", action="store_true", help="also run with warm workers (the default; the first run is --cold-workers)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tw-bench-hang-"))
    try:
        tw = trainwarden(root, args.nproc, args.bound)
        warm = trainwarden(root, args.nproc, args.bound, warm=True) if args.warm else None
        plain = plain_torchrun(root, args.nproc, args.bound)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"fault {FAULT}, {args.nproc} ranks, reference job pp2 x tp2 x dp2")
    print(f"trainwarden run : detected after {tw['detected_s']:.1f} s (culprit ranks {tw['culprits']}), "
          f"first step after resume {tw['recovered_s']:.1f} s after the fault, rc={tw['rc']}; deadline "
          f"{tw['deadline_s']} s ({tw['deadline']})"
          if tw["detected_s"] is not None and tw["recovered_s"] is not None else f"trainwarden run: {tw}")
    if warm is not None:
        print(f"... --warm-workers: detected after {warm['detected_s']:.1f} s (culprit ranks {warm['culprits']}), "
              f"first step after resume {warm['recovered_s']:.1f} s after the fault, rc={warm['rc']}; "
              f"deadline {warm['deadline_s']} s ({warm['deadline']})"
              if warm["detected_s"] is not None and warm["recovered_s"] is not None else f"warm: {warm}")
    if plain["progress_after_fault_s"] is None:
        print(f"plain torchrun  : no detection and no progress {args.bound:.0f} s after the fault "
              f"(cut off; gloo's default collective timeout is 1800 s), rc={plain['rc']}")
    else:
        print(f"plain torchrun  : progress {plain['progress_after_fault_s']:.1f} s after the fault, rc={plain['rc']}")
    if tw["detected_s"]:
        print(f"ratio (trainwarden detection / plain bound) <= {tw['detected_s'] / args.bound:.3f}")


if __name__ == "__main__":
    main()

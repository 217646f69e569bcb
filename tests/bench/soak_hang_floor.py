"""Soak: does the hang deadline's short floor (1.5 s) abort healthy jobs? Jobs under `trainwarden run` (defaults) while a
load generator turns on and off, counting hang incidents (there should be none: no fault is injected).

    python tests/bench/soak_hang_floor.py [--steps 300] [--load-period 8] [--jobs reference,ddp]

Jobs (each run once, one after the other):

  reference  the reference job (runtime/examples/gpt.py, 8 CPU ranks, pp2 x tp2 x dp2, a checkpoint every 5 steps
             and a memory snapshot every step): slow steps after each checkpoint (its background write shares
             the cores)
  ddp        an unchanged DDP script (tests/fixtures/unchanged/ddp_tutorial.py, 2 ranks, 0.05 s steps): a short
             step, so the floor is its deadline, far below 5x its p99
  loader     the same script pausing at every 40th step for a DataLoader whose worker prepares the first batch
             for 3 s (an epoch boundary) and for a 3 s read of a file

The load generator runs as many spinning processes as there are cores, on for ``--load-period`` seconds and off
for as long: the jobs' steps slow down suddenly and by a lot, the case a short floor fears most. Prints per job:
steps done, hang incidents (with their deadlines), restarts, and the range of the deadline the watchdog applied
(``trainwarden_hang_timeout_seconds``, sampled every second; the start-up and busy allowances left out).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _procs import stop_group

ROOT = Path(__file__).resolve().parents[2]
DDP = ROOT / "tests" / "fixtures" / "unchanged" / "ddp_tutorial.py"


def _spin(stop) -> None:
    while not stop.is_set():
        for _ in range(100_000):
            pass


def _load(period: float, stop) -> None:
    """Spin on every core for `period` seconds, rest for as long, until `stop`."""
    while not stop.is_set():
        burst = multiprocessing.Event()
        spinners = [multiprocessing.Process(target=_spin, args=(burst,), daemon=True) for _ in range(os.cpu_count() or 1)]
        for p in spinners:
            p.start()
        stop.wait(period)
        burst.set()
        for p in spinners:
            p.join(5)
        stop.wait(period)


def _command(job: str, steps: int) -> tuple[list[str], int]:
    if job == "reference":
        return ["-m", "trainwarden.runtime.examples.gpt", "--dp", "2", "--tp", "2", "--pp", "2", "--steps", str(steps),
                "--ckpt-every", "5"], 8
    pauses = []
    if job == "loader":
        for at in range(40, steps, 40):
            pauses += ["--pause", f"{at}:loader:3", "--pause", f"{at + 20}:read:3"]
    return [str(DDP), "--steps", str(steps * 4), "--sleep", "0.05", *pauses], 2


def _deadline(port: int, job: str) -> float | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read().decode()
    except OSError:
        return None
    m = re.search(r'^trainwarden_hang_timeout_seconds\{[^}]*job="' + re.escape(job) + r'"[^}]*\} (\S+)$', text,
                  re.MULTILINE)
    return float(m.group(1)) if m else None


def soak(job: str, steps: int, work: Path) -> dict:
    home = work / job
    command, nproc = _command(job, steps)
    env = dict(os.environ, TRAINWARDEN_STATE_HOME=str(home), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               OMP_NUM_THREADS="1")
    env.pop("TRAINWARDEN_FAULTS", None)
    home.mkdir(parents=True)
    port = _free_port()
    cmd = [sys.executable, "-m", "trainwarden.agent.cli", "run", "--nproc-per-node", str(nproc), "--job", job,
           "--metrics-port", str(port), "--max-restarts", "3", "--", *command]
    log_path = home / "run.log"
    deadlines = []
    began = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    try:
        while proc.poll() is None and time.monotonic() - began < 1800:
            d = _deadline(port, job)
            if d is not None:
                deadlines.append(d)
            time.sleep(1.0)
    finally:
        stop_group(proc)
    incidents = [json.loads(p.read_text()) for p in (home / "jobs" / job / "incidents").glob("*.json")]
    hangs = [i for i in incidents if i["kind"] == "hang"]
    text = log_path.read_text(errors="replace")
    return {"job": job, "rc": proc.returncode, "seconds": round(time.monotonic() - began, 1),
            "hangs": [(i["evidence"].get("timeout_seconds"), i["evidence"].get("deadline"),
                       i["evidence"].get("summary", "")[:120]) for i in hangs],
            "restarts": sum(1 for i in incidents if i["kind"] == "restart"),
            "succeeded": "succeeded after" in text,
            # the steady deadline (start-up and busy allowances, 180 s and more, left out)
            "deadline_s": (min(steady), max(steady)) if (steady := [d for d in deadlines if d < 180]) else None}


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="steps of the reference job (the DDP jobs run 4x as many)")
    ap.add_argument("--load-period", type=float, default=8.0, help="seconds of load, then as many without")
    ap.add_argument("--jobs", default="reference,ddp,loader")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tw-bench-soak-"))
    stop = multiprocessing.Event()
    loader = multiprocessing.Process(target=_load, args=(args.load_period, stop))  # its spinners are daemons
    loader.start()
    rows = []
    try:
        for job in args.jobs.split(","):
            print(f"[{job}] ...", flush=True)
            rows.append(soak(job, args.steps, work))
            print(f"[{job}] {rows[-1]}", flush=True)
    finally:
        stop.set()
        loader.join(30)
        if loader.is_alive():
            os.kill(loader.pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nload: {os.cpu_count()} spinning processes, {args.load_period:g} s on / {args.load_period:g} s off")
    print(f"{'job':10} {'result':10} {'seconds':>8} {'hangs':>6} {'restarts':>9}  deadline applied (s)")
    for r in rows:
        d = r["deadline_s"]
        print(f"{r['job']:10} {'succeeded' if r['succeeded'] else 'FAILED':10} {r['seconds']:8.1f} {len(r['hangs']):6d} "
              f"{r['restarts']:9d}  {f'{d[0]:.2f} - {d[1]:.2f}' if d else '-'}")
        for h in r["hangs"]:
            print(f"           hang at deadline {h[0]} s ({h[1]}): {h[2]}")


if __name__ == "__main__":
    main()

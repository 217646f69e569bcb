"""Benchmark: a node lost with a hot spare vs plain torchrun's crash recovery, in one run (issue 47).

    python tests/bench/bench_spare_swap.py [--only torchrun-crash,spare,torchrun-kill] [--window 40] [--json]

Parts, each on its own (root: the multi-host test bed, tests/testbed.py, for all but ``torchrun-crash``):

* ``torchrun-crash``: plain torchrun's crash recovery, the issue's yardstick ("within 0.5x plain torchrun's crash
  recovery"): bench_restart.py's job and fault (the reference job, 8 CPU ranks on one host, rank 5 SIGKILLs itself
  at step 16, ``torchrun --standalone``); seconds from the fault to the first step after it.
* ``spare``: `trainwarden run --nnodes 2:2 --spare-nodes 1` on three simulated nodes of two CPU ranks each (the
  reference GPT, tp 2 inside a node, dp 2 across, a checkpoint every 5 steps on shared storage, one etcd member):
  n0 and n1 train; rank 0's ``--window`` steps from step ``WARMUP_STEPS`` are the step time *without a spare*.
  Then n2 is started and waits as the spare; once it has waited ``SPARE_WARM_S`` (its zygote's imports done, as
  for a spare started with the job), rank 0's next ``--window`` steps are the step time *with a spare* (the same
  processes, so the difference is the spare's cost per step). Then n1 is killed (SIGKILL of everything in it)
  and the spare takes its ranks. Seconds after the kill: the new round closed (torchrun's "Rendezvous complete"
  on a survivor), rank 0 restored, rank 0's first step in the new round (training again at full size: n2's
  workers hold ranks 2,3, world size 4); steps lost (steps rank 0 had logged before the kill that the new round
  computes again).
* ``torchrun-kill``: plain torchrun on the bed, a node killed (bench_node_loss.py's ``torchrun-kill``: three
  nodes, n2 killed at step 12, the c10d store on n0): it shrinks and waits out torch's rendezvous timings.

Step times are the gpt example's own ("time Ts", rank 0), medians. Do not run beside other heavy work: the ranks
are CPU-bound and the nodes share the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_node_loss  # noqa: E402
import bench_restart  # noqa: E402
from bench_node_loss import RANK0_RESUMED_AT, TORCH_LOG, _stamp, _texts, _torch_stamp  # noqa: E402
from testbed import TestBed  # noqa: E402

PARTS = ("torchrun-crash", "spare", "torchrun-kill")
WARMUP_STEPS = 20
"""``spare``: the step-time window without the spare starts here (start-up and the first checkpoints behind)."""
SPARE_WARM_S = bench_node_loss.SPARE_WARM_S
RANK0_STEP_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank 0\] [\w.]+: step (\d+) loss \S+ "
                             r"time ([\d.]+)s", re.M)
RANKS = re.compile(r"\]   global_ranks=\[([\d, ]*)\]$", re.M)


def _command(bed: TestBed, node: str, ckpt: Path, state: Path) -> tuple[list[str], dict]:
    env = dict(os.environ, TRAINWARDEN_STATE_HOME=str(state / node), LOGLEVEL="INFO", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1")
    return [sys.executable, "-m", "trainwarden.agent.cli", "run", "--metrics-port", "0", "--nnodes", "2:2",
            "--spare-nodes", "1", "--nproc-per-node", "2", "--node", node,
            "--max-restarts", "3", "--job", "bench", "--etcd", bed.etcd_endpoints, "--",
            *bench_node_loss.GPT, "--steps", "100000", "--ckpt-dir", str(ckpt)], env


def _steps(text: str) -> list[tuple[float, int, float]]:
    """Rank 0's steps: (when it ended, step, its seconds), in time order."""
    return sorted((_stamp(m.group(1)), int(m.group(2)), float(m.group(3))) for m in RANK0_STEP_TIME.finditer(text))


def _wait(what: str, predicate, seconds: float, workdir: Path) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {seconds:.0f} s; see {workdir}")
        time.sleep(0.3)


def _window(steps: list[tuple[float, int, float]], first: int, count: int) -> list[float]:
    return [s for _, n, s in steps if first <= n < first + count]


def spare(workdir: Path, window: int, bound: float) -> dict:
    """The ``spare`` part (module docstring): step time without and with a spare waiting, then n1 killed."""
    ckpt, state = workdir / "ckpt", workdir / "state"
    with TestBed(nodes=3, etcd_members=1, workdir=workdir / "bed") as bed:
        logs = {n: workdir / f"{n}.log" for n in ("n0", "n1", "n2")}
        text = lambda *nodes: _texts(logs, nodes or logs)  # noqa: E731
        last = lambda: max((n for _, n, _ in _steps(text())), default=0)  # noqa: E731
        for node in ("n0", "n1"):
            cmd, env = _command(bed, node, ckpt, state)
            bed.spawn(node, cmd, log=logs[node], env=env)
        alone = WARMUP_STEPS
        _wait(f"rank 0 did not log steps {alone}-{alone + window - 1}", lambda: last() >= alone + window, 300, workdir)
        without = _window(_steps(text()), alone, window)
        cmd, env = _command(bed, "n2", ckpt, state)
        bed.spawn("n2", cmd, log=logs["n2"], env=env)
        _wait("n2 did not wait as the spare", lambda: "waits in round" in text("n2"), 120, workdir)
        time.sleep(SPARE_WARM_S)
        first = last() + 1
        _wait(f"rank 0 did not log steps {first}-{first + window - 1}", lambda: last() >= first + window, 300,
              workdir)
        with_spare = _window(_steps(text()), first, window)
        killed = time.time()
        bed.kill("n1")
        logs["n1"].rename(workdir / "n1.killed.log")
        logs["killed"] = workdir / "n1.killed.log"
        survivors = ("n0", "n2")
        job_logs = lambda: "".join(p.read_text(errors="replace") for n in survivors  # noqa: E731
                                   for p in (state / n).glob("jobs/*/logs/run.log"))

        def resumed() -> list[tuple[float, int]]:
            return [(_stamp(m.group(1)), int(m.group(2))) for m in RANK0_RESUMED_AT.finditer(text())
                    if _stamp(m.group(1)) > killed]

        row = {"part": "spare", "steps_alone": [alone, alone + window - 1], "step_s_alone": round(statistics.median(without), 3),
               "steps_with_spare": [first, first + window - 1], "step_s_with_spare": round(statistics.median(with_spare), 3)}
        try:
            _wait("no resume after the kill", resumed, bound, workdir)
            restored_at, restored_step = min(resumed())
            _wait("no step after the resume", lambda: any(t > restored_at for t, _, _ in _steps(text())), 60,
                  workdir)
        except RuntimeError as exc:
            return {**row, "train_s": None, "note": str(exc)}
        spare_log = "".join(p.read_text(errors="replace") for p in (state / "n2").glob("jobs/*/logs/run.log"))
        return {**row, **recovery(killed, text(), job_logs(), spare_log)}


def recovery(killed: float, text: str, job_logs: str, spare_log: str) -> dict:
    """Seconds from the kill (``killed``, unix time) to the new round closing (torchrun's lines in the survivors'
    job logs ``job_logs``), rank 0's restore and its first step after it (the workers' output ``text``, every
    node's); the steps lost; the global ranks of each round the spare ran (its job log ``spare_log``)."""
    resumes = [(_stamp(m.group(1)), int(m.group(2))) for m in RANK0_RESUMED_AT.finditer(text)
               if _stamp(m.group(1)) > killed]
    restored_at, restored_step = min(resumes)
    steps = _steps(text)
    rounds = [(_torch_stamp(*m.groups()[:2]), m.group(3)) for m in TORCH_LOG.finditer(job_logs)]
    closed = min((t for t, what in rounds if t > killed and what.startswith("Rendezvous complete")), default=None)
    reached = max(n for t, n, _ in steps if t < restored_at)
    return {"rdzv_s": round(closed - killed, 1) if closed is not None else None,
            "restore_s": round(restored_at - killed, 1),
            "train_s": round(min(t for t, _, _ in steps if t > restored_at) - killed, 1),
            "lost": reached - restored_step,
            "spare_ranks": [[int(r) for r in found.split(",")] for found in RANKS.findall(spare_log)],
            "source": "memory" if "resumed from the memory" in text else "disk"}


def torchrun_crash(workdir: Path) -> dict:
    row = bench_restart.run_once("torchrun", 8, workdir)
    return {"part": "torchrun-crash", "train_s": row.get("first_step"), "note": row.get("error", "")}


def torchrun_kill(workdir: Path, bound: float) -> dict:
    row = bench_node_loss.run_scenario("torchrun-kill", bound, workdir)
    return {"part": "torchrun-kill", "rdzv_s": row.get("rdzv_s"), "restore_s": row.get("restore_s"),
            "train_s": row.get("step_s"), "lost": row.get("lost"), "note": row.get("note", "")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="torchrun-crash,spare", help=f"comma-separated parts of {PARTS}")
    p.add_argument("--window", type=int, default=40, help="steps whose time is compared without and with a spare")
    p.add_argument("--bound", type=float, default=120.0, help="seconds to wait for training after the kill")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the test bed tears itself down
    parts = [s for s in args.only.split(",") if s]
    if unknown := [s for s in parts if s not in PARTS]:
        p.error(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    if (reason := TestBed.unavailable()) and parts != ["torchrun-crash"]:
        print(f"bench_spare_swap: {reason}", file=sys.stderr)
        return 2
    rows = {}
    load = os.getloadavg()[0]
    for part in parts:
        with tempfile.TemporaryDirectory(prefix=f"spareswap-{part}-") as tmp:
            print(f"[{part}] ...", file=sys.stderr, flush=True)
            try:
                if part == "torchrun-crash":
                    rows[part] = torchrun_crash(Path(tmp))
                elif part == "spare":
                    rows[part] = spare(Path(tmp), args.window, args.bound)
                else:
                    rows[part] = torchrun_kill(Path(tmp), args.bound)
            finally:
                bench_node_loss._sweep_killed_runs()
            print(f"[{part}] {rows[part]}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"load average at the start: {load:.1f}")
    crash, swap = rows.get("torchrun-crash", {}).get("train_s"), rows.get("spare", {}).get("train_s")
    for part, row in rows.items():
        print(f"{part:15} " + " ".join(f"{k}={v}" for k, v in row.items() if k != "part"))
    if crash and swap:
        print(f"spare swap / plain torchrun's crash recovery: {swap / crash:.2f} (goal <= 0.5)")
    if "spare" in rows:
        with_s, without = rows["spare"]["step_s_with_spare"], rows["spare"]["step_s_alone"]
        print(f"step time with a spare waiting / without: {with_s:.3f} / {without:.3f} s = {with_s / without:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

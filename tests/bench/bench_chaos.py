"""Benchmark: goodput under a fault mix, `trainwarden run` (its defaults) vs plain torchrun, same job, same schedule.

    python tests/bench/bench_chaos.py [--gap 120] [--hang-cap 60] [--only trainwarden|torchrun] [--json] [--keep DIR]
    python tests/bench/bench_chaos.py --bed [--gap 40] [--rate 20mbit]     (root: the multi-node test bed)

Both launchers train the reference job (``-m trainwarden.runtime.examples.gpt --dp 2 --tp 2 --pp 2``, 8 CPU ranks,
gloo, a checkpoint every 10 steps, ``5 x gap`` steps) through one fault schedule, every ``gap`` steps (G):

  step G        crash     rank 5 SIGKILLs itself
  step 2G       hang      rank 2 blocks forever at the start of the step (its peers wait in a collective)
  steps 3G..    slow      rank 6 computes 3x slower for G/3 steps (a throttled GPU)
  step 4G       corrupt   the newest checkpoint (the one of step 4G) is truncated on disk right after its
                          commit, then rank 1 crashes at step 4G+3: the restore must set it aside and resume from
                          the one before (step 4G-10)

`trainwarden run` runs with no flags but the job's (``--max-restarts 4``); plain torchrun runs ``--standalone`` (c10d)
with ``--max-restarts 4``. What plain torchrun cannot survive by itself is charged at its real cost with the cap
stated: a gloo hang waits for the collective timeout (30 minutes by default), so after ``--hang-cap`` seconds
without a step this script SIGKILLs torchrun's workers (what the timeout would do, sooner) and charges the
remaining ``1800 - waited`` seconds to torchrun's wall time.

Accounting, per launcher, from the workers' own step log (rank 0 prints every step's duration; the independent
measure): wall = the launch to the last step's end; productive = the duration of the last run of every step index;
badput = the rest: startup (the launch to the first step's start), steps redone (earlier runs of redone steps),
recovery (each failure's last step end to the next round's first step start), other (between steps, checkpoint
stalls, the slow rank's excess). For `trainwarden run` it also prints the agent's own ledger (the job's
history/goodput.json, agent/launch/goodput.py) beside it, and the difference of the two goodput ratios.

Do not run beside other heavy work: 8 ranks on a small machine are CPU-bound.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from _procs import stop_group

sys.path.insert(0, str(Path(__file__).parents[1]))  # testbed.py
sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from gpt_helpers import gpt_env  # noqa: E402

JOB = "benchchaos"
GLOO_TIMEOUT_S = 1800.0
CKPT_EVERY = 10
STEP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*\bstep (\d+) loss \S+ time ([\d.]+)s", re.M)
COMMITTED = re.compile(r"checkpoint step (\d+) committed: (\S+) ")


def _stamp(text: str) -> float:
    return dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def schedule(gap: int) -> tuple[str, int]:
    """TRAINWARDEN_FAULTS for the schedule (module docstring) and the step whose checkpoint gets corrupted."""
    if gap % CKPT_EVERY or gap < 3 * CKPT_EVERY:
        raise SystemExit(f"--gap must be a multiple of {CKPT_EVERY} and at least {3 * CKPT_EVERY}")
    corrupt = 4 * gap
    faults = [f"crash:rank=5,step={gap}", f"hang:rank=2,step={2 * gap}",
              f"slow:rank=6,from={3 * gap},until={3 * gap + gap // 3},factor=3", f"crash:rank=1,step={corrupt + 3}"]
    return ";".join(faults), corrupt


def _command(launcher: str, work: Path, steps: int, faults: str) -> tuple[list[str], dict, Path]:
    """argv, environment and the checkpoint directory."""
    gpt = ["-m", "trainwarden.runtime.examples.gpt", "--dp", "2", "--tp", "2", "--pp", "2", "--steps", str(steps),
           "--ckpt-every", str(CKPT_EVERY)]
    env = gpt_env()
    env["TRAINWARDEN_FAULTS"] = faults
    env["TMPDIR"] = str(work / "tmp")  # torchrun's torchelastic_* directories and the launchers' sockets
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    if launcher == "trainwarden":
        env["TRAINWARDEN_STATE_HOME"] = str(work / "state")
        return ([sys.executable, "-m", "trainwarden.agent.cli", "run", "--nproc-per-node", "8", "--job", JOB,
                 "--metrics-port", "0", "--max-restarts", "4", "--", *gpt], env,
                work / "state" / "jobs" / JOB / "checkpoints")
    state = work / "plain"
    env.update(TRAINWARDEN_STATE_DIR=str(state), TRAINWARDEN_CHECKPOINT_DIR=str(state / "ckpt"))
    return ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
             "--max-restarts", "4", *gpt], env, state / "ckpt")


def _corrupt(path: Path) -> str:
    """Truncate the largest file of a committed checkpoint to half: what a torn write or bit rot leaves."""
    files = sorted((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    victim = files[-1]
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size // 2)
    return f"{victim.relative_to(path)} {size} -> {size // 2} bytes"


def _kill_workers(proc: subprocess.Popen) -> list[int]:
    """SIGKILL the launcher's worker processes (children of torchrun's agent): what gloo's timeout ends in."""
    killed = []
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return killed
    for child in children:
        try:
            if "trainwarden.runtime.examples.gpt" in " ".join(child.cmdline()):
                child.send_signal(signal.SIGKILL)
                killed.append(child.pid)
        except psutil.Error:
            continue
    return killed


def run_once(launcher: str, work: Path, gap: int, hang_cap: float, timeout: float) -> dict:
    faults, corrupt_step = schedule(gap)
    steps = 5 * gap
    cmd, env, ckpt_dir = _command(launcher, work, steps, faults)
    log_path = work / "output.log"
    notes: list[str] = []
    hang_waited = None
    corrupted = None
    launched = time.time()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        last_count, last_change = 0, time.monotonic()
        while proc.poll() is None and time.time() - launched < timeout:
            time.sleep(0.2)
            text = log_path.read_text(errors="replace")
            if corrupted is None:
                for step, path in COMMITTED.findall(text):
                    if int(step) == corrupt_step:
                        corrupted = _corrupt(Path(path))
                        notes.append(f"corrupted checkpoint step {step}: {corrupted}")
            count = len(STEP.findall(text))
            if count != last_count:
                last_count, last_change = count, time.monotonic()
            elif launcher == "torchrun" and hang_waited is None and count \
                    and time.monotonic() - last_change > hang_cap:
                hang_waited = time.monotonic() - last_change
                notes.append(f"no step for {hang_waited:.0f} s: SIGKILLed workers {_kill_workers(proc)} (gloo's "
                             f"timeout would, after {GLOO_TIMEOUT_S:.0f} s)")
        rc = proc.poll()
    finally:
        stop_group(proc)
    output = log_path.read_text(errors="replace")
    result = {"launcher": launcher, "rc": rc, "notes": notes, "faults": faults,
              **independent(output, launched, hang_waited)}
    if launcher == "trainwarden":
        ledger = work / "state" / "jobs" / JOB / "history" / "goodput.json"
        result["ledger"] = json.loads(ledger.read_text()) if ledger.exists() else None
    if corrupted is None:
        notes.append(f"the checkpoint of step {corrupt_step} was never seen committed: not corrupted")
    resumed = re.findall(r"resumed from checkpoint step (\d+)", output)
    result["resumed_from"] = [int(s) for i, s in enumerate(resumed) if i == 0 or s != resumed[i - 1]]
    return result


def independent(output: str, launched: float, hang_waited: float | None) -> dict:
    """The accounting from the logging rank's step lines (module docstring)."""
    runs = sorted((_stamp(t), int(s), float(d)) for t, s, d in STEP.findall(output))  # (end, step, duration)
    if not runs:
        return {"error": "no step was logged"}
    kept: dict[int, float] = {}
    redone = 0.0
    recovery, outages = 0.0, 0
    previous_end, previous_step = None, None
    for end, step, duration in runs:
        if step in kept:
            redone += kept[step]
        if previous_step is not None and step <= previous_step:  # a new round resumed from a checkpoint
            recovery += max(0.0, end - duration - previous_end)
            outages += 1
        kept[step] = duration
        previous_end, previous_step = end, step
    # a hang's wait (trainwarden detects it; plain torchrun is cut off by this script) shows as a long gap before
    # the resumed round: it is in ``recovery``; torchrun's uncut remainder is charged on top
    penalty = max(0.0, GLOO_TIMEOUT_S - hang_waited) if hang_waited is not None else 0.0
    wall = runs[-1][0] - launched + penalty
    productive = sum(kept.values())
    startup = runs[0][0] - runs[0][2] - launched
    parts = {"startup": startup, "recovery": recovery + penalty, "steps_redone": redone}
    parts["other"] = wall - productive - sum(parts.values())
    return {"wall_s": round(wall, 1), "productive_s": round(productive, 1), "goodput": round(productive / wall, 4),
            "lost_s": round(wall - productive, 1), "badput_s": {k: round(v, 1) for k, v in parts.items()},
            "outages": outages, "last_step": max(kept), "hang_penalty_s": round(penalty, 1)}


def run_bed(launcher: str, work: Path, gap: int, rate: str, timeout: float) -> dict:
    """The multi-node schedule (``--bed``): three simulated nodes of two ranks (tests/testbed.py), tensor
    parallelism 2 inside a node and data parallelism across; n2 is killed at step G, n1's link is slowed to
    ``rate`` both ways from step 2G for G/2 steps, the job ends at 3G. Plain torchrun keeps its c10d store on n0,
    which survives (with the store on the lost node it does not recover at all: bench_node_loss.py)."""
    from bench_node_loss import _command as bed_command
    from testbed import TestBed

    scenario = "tw-kill-warm" if launcher == "trainwarden" else "torchrun-kill"
    steps, notes = 3 * gap, []
    ckpt, state = work / "ckpt", work / "state"
    with TestBed(nodes=3, etcd_members=3 if launcher == "trainwarden" else 0, workdir=work / "bed") as bed:
        logs = {n: work / f"{n}.log" for n in ("n0", "n1", "n2")}
        launched = time.time()
        for node in logs:
            cmd, env = bed_command(scenario, bed, node, ckpt, state)
            cmd[cmd.index("--steps") + 1] = str(steps)
            env["TMPDIR"] = str(work / "tmp" / node)  # what a killed node leaves stays in the run's directory
            Path(env["TMPDIR"]).mkdir(parents=True, exist_ok=True)
            bed.spawn(node, cmd, log=logs[node], env=env)

        def last_step() -> int:
            return max((int(s) for n in logs for _, s, _ in STEP.findall(logs[n].read_text(errors="replace"))
                        if logs[n].exists()), default=0)

        def wait_for_step(step: int) -> None:
            while last_step() < step:
                if time.time() - launched > timeout:
                    raise RuntimeError(f"{launcher}: no step {step} within {timeout:.0f} s; see {work}")
                time.sleep(0.2)

        wait_for_step(gap)
        bed.kill("n2")
        notes.append(f"n2 killed after step {last_step()}")
        wait_for_step(2 * gap)
        bed.degrade("n1", rate)
        notes.append(f"n1's link slowed to {rate} after step {last_step()}")
        wait_for_step(2 * gap + gap // 2)
        bed.restore_link("n1")
        notes.append(f"n1's link restored after step {last_step()}")
        wait_for_step(steps)
        time.sleep(2)
        output = "".join(logs[n].read_text(errors="replace") for n in logs if logs[n].exists())
    resumed = sorted(set(int(s) for s in re.findall(r"resumed from checkpoint step (\d+)", output)))
    return {"launcher": launcher, "rc": None, "notes": notes, "faults": "kill n2; slow n1's link",
            "resumed_from": resumed, **independent(output, launched, None)}


def agreement(ledger: dict, row: dict) -> dict:
    """The ledger against the step log on what both measure: the time in the steps kept (the ledger's productive
    time plus the slow causes' excess, which the step log cannot tell from the step) and the wall time."""
    kept = ledger["productive_s"] + sum(ledger["badput_s"].get(c, 0.0) for c in ("straggler", "comm_regression"))
    ratio = kept / ledger["wall_s"] if ledger["wall_s"] else 0.0
    return {"ledger_kept_s": kept, "kept_rel": kept / row["productive_s"] - 1, "wall_rel":
            ledger["wall_s"] / row["wall_s"] - 1, "ledger_ratio": ratio, "ratio_diff": ratio - row["goodput"]}


def describe(row: dict) -> str:
    if "error" in row:
        return f"{row['launcher']}: {row['error']}; rc={row['rc']}; {'; '.join(row['notes'])}"
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f}s" for k, v in row["badput_s"].items())
    line = (f"{row['launcher']}: goodput {100 * row['goodput']:.1f}% of {row['wall_s']:.1f}s ({parts}); "
            f"{row['outages']} outages, resumed from {row['resumed_from']}, last step {row['last_step']}, "
            f"rc={row['rc']}")
    ledger = row.get("ledger")
    if ledger:
        causes = ", ".join(f"{k} {v:.1f}s" for k, v in sorted(ledger["badput_s"].items(), key=lambda kv: -kv[1])
                           if v >= 0.05)
        check = agreement(ledger, row)
        line += (f"\n  the agent's ledger: goodput {100 * ledger['ratio']:.1f}% of {ledger['wall_s']:.1f}s ({causes})"
                 f"\n  against the step log: time in kept steps {check['ledger_kept_s']:.1f}s vs {row['productive_s']:.1f}s "
                 f"({100 * check['kept_rel']:+.1f}%), wall {ledger['wall_s']:.1f}s vs {row['wall_s']:.1f}s "
                 f"({100 * check['wall_rel']:+.1f}%), their ratio {100 * check['ledger_ratio']:.1f}% vs "
                 f"{100 * row['goodput']:.1f}% ({100 * check['ratio_diff']:+.2f} points)")
    if row["notes"]:
        line += "\n  " + "\n  ".join(row["notes"])
    return line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gap", type=int, help="steps between faults (default 120, with --bed 40; a multiple of 10)")
    p.add_argument("--hang-cap", type=float, default=60.0,
                   help="seconds plain torchrun may wait in the hang before its workers are killed (default 60)")
    p.add_argument("--only", choices=("trainwarden", "torchrun"), action="append", help="run only this launcher")
    p.add_argument("--timeout", type=float, default=1800.0, help="give up on a launcher after this many seconds")
    p.add_argument("--bed", action="store_true", help="the multi-node schedule instead: node kill and a slow link "
                   "on three simulated nodes (root; network namespaces)")
    p.add_argument("--rate", default="20mbit", help="the slow link's rate with --bed (default 20mbit)")
    p.add_argument("--json", action="store_true", help="also print every run as JSON")
    p.add_argument("--keep", metavar="DIR", help="keep each run's logs under DIR")
    args = p.parse_args(argv)
    args.gap = args.gap or (40 if args.bed else 120)
    if args.bed:
        from testbed import TestBed

        reason = TestBed.unavailable()
        if reason:
            p.error(f"--bed: {reason}")
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the test bed tears itself down
    launchers = list(args.only) if args.only else ["trainwarden", "torchrun"]
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    rows = []
    for launcher in launchers:
        work = Path(tempfile.mkdtemp(prefix=f"tw-bench-chaos-{launcher}-", dir=args.keep))
        try:
            started = time.monotonic()
            row = run_bed(launcher, work, args.gap, args.rate, args.timeout) if args.bed else \
                run_once(launcher, work, args.gap, args.hang_cap, args.timeout)
            rows.append(row)
            print(f"[{time.monotonic() - started:.0f} s] {describe(row)}", flush=True)
        finally:
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
    if args.bed:
        print(f"\nschedule: n2 killed at step {args.gap}, n1's link at {args.rate} from step {2 * args.gap} for "
              f"{args.gap // 2} steps, {3 * args.gap} steps; 3 nodes x 2 ranks (tp2, dp across nodes); "
              f"nproc={os.cpu_count()}, load average now {os.getloadavg()[0]:.1f}")
    else:
        faults, _ = schedule(args.gap)
        print(f"\nschedule {faults} (+ the newest checkpoint corrupted before the last crash), {5 * args.gap} "
              f"steps, 8 ranks pp2 x tp2 x dp2; nproc={os.cpu_count()}, load average now {os.getloadavg()[0]:.1f}")
    ok = [r for r in rows if "error" not in r]
    for r in ok:
        minutes = r["wall_s"] / 60
        print(f"{r['launcher']:12} goodput {100 * r['goodput']:5.1f}%  lost {r['lost_s']:7.1f}s  wall {r['wall_s']:7.1f}s"
              f"  one fault every {minutes / (2 if args.bed else 4):.1f} min of its wall time")
    by = {r["launcher"]: r for r in ok}
    if "trainwarden" in by and "torchrun" in by:
        print(f"lost seconds, torchrun / trainwarden: {by['torchrun']['lost_s'] / by['trainwarden']['lost_s']:.2f}x")
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())

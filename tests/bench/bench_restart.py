"""Benchmark: where the time of a restart goes, `trainwarden run` vs plain torchrun, same job and fault.

    python tests/bench/bench_restart.py [--runs 3] [--nproc 8] [--only trainwarden|torchrun] [--json] [--keep DIR]

Both launchers train the reference job (``-m trainwarden.runtime.examples.gpt --dp 2 --tp 2 --pp 2``, 8 CPU
ranks, gloo, 30 steps, a checkpoint every 10) with ``crash:rank=5,step=16`` (rank 5 SIGKILLs itself at the
start of step 16) and ``--max-restarts 1``, each with its own defaults otherwise (monitor interval: 1 s for
`trainwarden run`, 0.1 s for torchrun). Plain torchrun runs ``--standalone`` (c10d) with the shared-store
workaround (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``). The workers get ``TRAINWARDEN_TIMINGS``, so each rank
marks the end of its start-up phases (runtime/examples/timings.py).

Phases of the crash -> restart, as wall-clock times since the fault, in the order they happen:

  fault        the fault marker's time (runtime/faults.py writes it just before the SIGKILL)
  old gone     the last worker of the failed round has exited (this script polls the agent's children
               every 20 ms: _proctree.py): the survivors exit on their own when their next collective with
               rank 5 fails (runtime/peer_failure.py), or the agent SIGTERMs them when it notices the crash
               first, whichever comes first
  detected     the elastic agent logs "Worker group FAILED ... will restart" (torch's agent, which both
               launchers run; LOGLEVEL=INFO; for `trainwarden run` its lines are in the job's logs/run.log).
               The agent polls its workers every --monitor-interval; the poll that sees a failure stops the
               other workers before it returns (torch's SubprocessContext._poll), so this line comes after
               "old gone"
  rdzv closed  the agent logs "Rendezvous complete for workers" for the new round (torch's dynamic
               rendezvous, etcd3 for `trainwarden run`, c10d for torchrun; its own "has joined round" line is
               not logged at INFO)
  started      the earliest start time of a new worker process (from /proc)
  imported     the example's imports (torch among them) are done
  pg up        ``init_process_group`` returned (the default gloo group)
  mesh up      the device mesh's process groups are up
  model built  model sharded, optimizer and trainwarden runtime ready
  restored     the checkpoint is restored
  first step   the first step completed after the resume (the reporting rank's step line)

For every worker-side phase (imported .. restored) the time is the LATEST rank's: the slowest rank gates the
next collective, so it gates the step. The torch agent rendezvouses before it starts the new workers, so
"rdzv closed" comes before "started". The agent's log lines and the workers' step lines have millisecond
timestamps; process start times are exact to a clock tick (10 ms). Each run prints each phase's time since the fault and (in
parentheses) the time since the phase before; then the medians per launcher and the ratio
trainwarden / torchrun of fault -> first step.

Do not run beside other heavy work: 8 ranks on a small machine are CPU-bound, and the start-up phases measure
mostly how fast 8 interpreters import torch on the cores there are.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _procs import stop_group
from _proctree import Worker, WorkerWatch

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from gpt_helpers import gpt_env  # noqa: E402

from trainwarden.runtime.examples.timings import TIMINGS_ENV, read_marks  # noqa: E402

FAULT = "crash:rank=5,step=16"
FAULT_STEP = 16
GPT = ["-m", "trainwarden.runtime.examples.gpt", "--dp", "2", "--tp", "2", "--pp", "2", "--steps", "30",
       "--ckpt-every", "10"]
LAUNCHERS = ("trainwarden", "torchrun", "trainwarden-warm")
"""``trainwarden``: ``trainwarden run --cold-workers`` (new interpreters, as torchrun starts them);
``trainwarden-warm``: the default, warm workers (restarted workers fork from a zygote with torch imported,
runtime/zygote.py); its "started" is the client process torch's agent starts per rank."""
JOB = "benchrestart"

PHASES = ("old_gone", "detected", "rdzv", "started", "imported", "pg_up", "mesh_up", "model_built", "restored",
          "first_step")
LABELS = {"detected": "detected", "old_gone": "old gone", "rdzv": "rdzv closed", "started": "started",
          "imported": "imported", "pg_up": "pg up", "mesh_up": "mesh up", "model_built": "model built",
          "restored": "restored", "first_step": "first step"}
MARKED = ("imported", "pg_up", "mesh_up", "model_built", "restored")
"""Phases the workers mark themselves (runtime/examples/timings.py); the latest rank's time counts."""

STEP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*\bstep (\d+) loss ", re.M)
RESUMED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*\bresumed from checkpoint step (\d+)", re.M)
# torch's own log lines (glog style): "I1122 14:37:14.328000 4242 torch/.../api.py:707] [default] Rendezvous'ing ..."
TORCH_LINE = re.compile(r"^\[?I(\d{4}) (\d\d:\d\d:\d\d\.\d{6}) \d+ \S+\] (.*)$", re.M)
DETECTED = re.compile(r"^\[\w+\] Worker group (FAILED|UNHEALTHY)\. ")
RDZV_CLOSED = re.compile(r"^\[\w+\] Rendezvous complete for workers\.")
RDZV_BEGIN = re.compile(r"^\[\w+\] Rendezvous'ing worker group")


def _stamp(text: str) -> float:
    return dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def torch_lines(text: str, year: int) -> list[tuple[float, str]]:
    """(time, message) of torch's glog-style INFO lines; the year is not in them."""
    return [(dt.datetime.strptime(f"{year}{mmdd} {hms}", "%Y%m%d %H:%M:%S.%f").timestamp(), message)
            for mmdd, hms, message in TORCH_LINE.findall(text)]


def fault_time(state_dir: Path) -> float | None:
    markers = list((state_dir / "faults").glob("fired-*"))
    return float(markers[0].read_text().split()[0]) if markers else None


def breakdown(fault: float, output: str, agent_log: str, marks: list[dict], workers: list[Worker],
              nproc: int) -> dict:
    """Each phase's time since the fault (None where not seen), plus the evidence behind it (module docstring).

    ``output``: the workers' lines (step and resume lines); ``agent_log``: torch's agent lines; ``marks``:
    the workers' phase marks; ``workers``: the agent's children as the watch saw them."""
    at: dict[str, float | None] = dict.fromkeys(PHASES)
    notes: list[str] = []
    agent = [(t, m) for t, m in torch_lines(agent_log, dt.datetime.fromtimestamp(fault).year) if t >= fault]
    at["detected"] = next((t for t, m in agent if DETECTED.match(m)), None)
    after = at["detected"] or fault
    rdzv_begin = next((t for t, m in agent if t >= after and RDZV_BEGIN.match(m)), None)
    at["rdzv"] = next((t for t, m in agent if t >= after and RDZV_CLOSED.match(m)), None)
    old = [w for w in workers if w.started < fault]
    new = [w for w in workers if w.started >= fault]
    if len(old) != nproc:
        notes.append(f"{len(old)} workers seen before the fault, expected {nproc}")
    if old and all(w.gone is not None for w in old):
        at["old_gone"] = max(w.gone for w in old)
    at["started"] = min((w.started for w in new), default=None)
    round_ = min((m["restart_count"] for m in marks if m["t"] >= fault), default=None)
    spread = {}
    for phase in MARKED:
        times = [m["t"] for m in marks if m["restart_count"] == round_ and m["phase"] == phase]
        if len(times) != nproc:
            notes.append(f"{phase}: {len(times)} of {nproc} ranks marked it")
        if times:
            at[phase] = max(times)
            spread[phase] = round(max(times) - min(times), 2)
    resumed = [(_stamp(t), int(s)) for t, s in RESUMED.findall(output) if _stamp(t) >= fault]
    if resumed:
        at["first_step"] = next((_stamp(t) for t, s in STEP.findall(output) if _stamp(t) >= resumed[0][0]), None)
    result = {phase: None if t is None else round(t - fault, 2) for phase, t in at.items()}
    result["evidence"] = {
        "resumed_from_step": resumed[0][1] if resumed else None,
        "rdzv_begin_s": None if rdzv_begin is None else round(rdzv_begin - fault, 2),
        "last_new_worker_started_s": round(max(w.started for w in new) - fault, 2) if new else None,
        "new_workers": len(new),
        "rank_spread_s": spread,
        "notes": notes,
    }
    return result


def _command(launcher: str, nproc: int, work: Path) -> tuple[list[str], dict, Path]:
    """argv, environment and the job's state directory (where the fault marker goes)."""
    env = gpt_env()
    env.update({"TRAINWARDEN_FAULTS": FAULT, TIMINGS_ENV: str(work / "marks"), "LOGLEVEL": "INFO"})
    if launcher.startswith("trainwarden"):
        env["TRAINWARDEN_STATE_HOME"] = str(work / "state")
        warm = ["--warm-workers"] if launcher == "trainwarden-warm" else ["--cold-workers"]
        return ([sys.executable, "-m", "trainwarden.agent.cli", "run", "--nproc-per-node", str(nproc), "--job", JOB,
                 "--metrics-port", "0", "--max-restarts", "1", *warm, "--", *GPT], env, work / "state" / "jobs" / JOB)
    state = work / "plain"
    env.update(TRAINWARDEN_STATE_DIR=str(state), TRAINWARDEN_CHECKPOINT_DIR=str(state / "ckpt"))
    return ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
             "--max-restarts", "1", *GPT], env, state)


def _is_launcher(launcher: str):
    module = "trainwarden.agent.launch.elastic" if launcher.startswith("trainwarden") else "torch.distributed.run"
    return lambda cmdline: module in cmdline


def run_once(launcher: str, nproc: int, work: Path, timeout: float = 400.0) -> dict:
    cmd, env, state = _command(launcher, nproc, work)
    log_path = work / "output.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    watch = WorkerWatch(proc.pid, _is_launcher(launcher))
    watch.start()
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        stop_group(proc)
        watch.stop()
        leftovers = watch.kill_leftovers()
    output = log_path.read_text(errors="replace")
    agent_log = output
    if launcher.startswith("trainwarden"):  # torchrun's own INFO lines go to the job's log only (agent/launch/output.py)
        run_log = state / "logs" / "run.log"
        agent_log = run_log.read_text(errors="replace") if run_log.exists() else ""
    fault = fault_time(state)
    result = {"launcher": launcher, "rc": rc}
    if fault is None:
        return {**result, "error": f"the fault never fired; see {log_path}"}
    result.update(breakdown(fault, output, agent_log, read_marks(work / "marks") if (work / "marks").exists() else [],
                            watch.workers(), nproc))
    if leftovers:
        result["evidence"]["notes"].append(f"killed workers left running: {leftovers}")
    if watch.error is not None:
        result["evidence"]["notes"].append(f"process watch: {watch.error!r}")
    if launcher.startswith("trainwarden"):  # when the supervisor recorded the crash incident (it hears of it from the agent)
        crashes = [json.loads(p.read_text()) for p in (state / "incidents").glob("*.json")]
        crashes = [c for c in crashes if c.get("kind") == "crash"]
        if crashes:
            result["evidence"]["incident_detected_s"] = round(min(c["detected_at"] for c in crashes) - fault, 2)
    return result


def _cell(value: float | None, sign: str = "") -> str:
    return "-" if value is None else f"{value:{sign}.2f}"


def describe(row: dict) -> str:
    """One run: each phase's seconds since the fault, and since the phase before it."""
    if "error" in row:
        return f"{row['launcher']}: {row['error']}"
    parts, previous = [], 0.0
    for phase in PHASES:
        t = row[phase]
        parts.append(f"{LABELS[phase]} {_cell(t)} ({_cell(None if t is None else t - previous, '+')})")
        previous = previous if t is None else t
    notes = row["evidence"]["notes"]
    return f"{row['launcher']}: " + ", ".join(parts) + f"; rc={row['rc']}" + (f"; {'; '.join(notes)}" if notes else "")


def medians(rows: list[dict]) -> dict[str, float | None]:
    out = {}
    for phase in PHASES:
        values = [r[phase] for r in rows if r.get(phase) is not None]
        out[phase] = statistics.median(values) if values and len(values) == len(rows) else None
    return out


def table(rows: list[dict], launchers: list[str]) -> str:
    """Markdown: the median time since the fault of every phase per launcher, deltas in parentheses."""
    head = "| launcher | runs | " + " | ".join(LABELS[p] for p in PHASES) + " |"
    lines = [head, "|" + "---|" * (len(PHASES) + 2)]
    for launcher in launchers:
        mine = [r for r in rows if r["launcher"] == launcher and "error" not in r]
        if not mine:
            continue
        med, previous, cells = medians(mine), 0.0, []
        for phase in PHASES:
            t = med[phase]
            cells.append("-" if t is None else f"{t:.1f} ({t - previous:+.1f})")
            previous = previous if t is None else t
        lines.append(f"| {launcher} | {len(mine)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="runs per launcher; medians are printed (default 3)")
    p.add_argument("--nproc", type=int, default=8, help="ranks (default 8: the reference pp2 x tp2 x dp2 needs 8)")
    p.add_argument("--only", choices=LAUNCHERS, action="append",
                   help="run only these launchers (repeatable; default: all, alternating)")
    p.add_argument("--json", action="store_true", help="also print every run's phases and evidence as JSON")
    p.add_argument("--keep", metavar="DIR", help="keep each run's logs and marks under DIR")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be >= 1")
    launchers = list(args.only) if args.only else list(LAUNCHERS)
    rows = []
    for i in range(args.runs):
        for launcher in launchers:  # alternating, so a drift in the machine's load touches both alike
            work = Path(tempfile.mkdtemp(prefix=f"tw-bench-restart-{launcher}-", dir=args.keep))
            try:
                started = time.monotonic()
                row = run_once(launcher, args.nproc, work)
                row["run"] = i + 1
                rows.append(row)
                print(f"[run {i + 1}/{args.runs}, {time.monotonic() - started:.0f} s] {describe(row)}", flush=True)
            finally:
                if not args.keep:
                    shutil.rmtree(work, ignore_errors=True)
    print(f"\nfault {FAULT}, {args.nproc} ranks, reference job pp2 x tp2 x dp2; seconds after the fault, medians "
          f"(+ since the phase before); worker phases: the latest rank; nproc={os.cpu_count()}, "
          f"load average now {os.getloadavg()[0]:.1f}\n")
    print(table(rows, launchers))
    med = {launcher: medians([r for r in rows if r["launcher"] == launcher and "error" not in r])
           for launcher in launchers}
    plain = med.get("torchrun", {}).get("first_step")
    for name in ("trainwarden", "trainwarden-warm"):
        tw = med.get(name, {}).get("first_step")
        if tw and plain:
            print(f"fault -> first step: {name} {tw:.1f} s, torchrun {plain:.1f} s, ratio {name}/torchrun "
                  f"{tw / plain:.2f}")
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0 if all("error" not in r and r["first_step"] is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

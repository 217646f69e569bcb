"""Benchmark: what auto-instrumentation costs an unchanged script, and how soon it turns a hang into an incident.

    python tests/bench/bench_auto_instrument.py [--rounds 5] [--measure-steps 400] [--hang-trials 4]

Three parts (``--only overhead,hook,hang``), every job on loopback under ``trainwarden run`` with its in-process
agent (embedded etcd, ``--metrics-port 0``):

overhead  An unchanged gloo DDP script of 2 ranks (it never imports trainwarden) whose step is about
          ``--step-ms`` of real CPU work (256x256 matmuls, their count calibrated here by CPU time, one thread
          per rank: OMP_NUM_THREADS=1) plus a small DDP model's forward, backward (a gloo all-reduce) and
          AdamW step. It runs with auto-instrumentation and with ``--no-auto-instrument`` (the agent alive both
          times: same launcher, same Flight Recorder recording, same socket in the environment), the two
          alternating round after round, in the order A B, B A, A B, ... so drift on a shared machine falls
          on both alike. The script times each of its steps itself (perf_counter; also the training thread's
          and the process's CPU time), so start-up is not compared; the steps of the first ``--warmup-s`` of
          each run (rank 0's clock, agreed by a broadcast every 10 steps) are not measured: they cover the
          agent's 10 s before it slows the Flight Recorder reads of a quiet job (the steady state). Reported
          per side: median and mean step time, per round and over rounds; the ratio instrumented / not, and
          its spread over rounds; per step, the training thread's CPU time, its time off the CPU (waiting for
          its peer in the all-reduce, for the GIL, or for a core) and the other threads' CPU time. A sampler
          thread reads /proc every 0.25 s and reports, per run, how many cores other work on the machine used
          during the measured steps (the machine's busy time less this benchmark's processes): the main noise
          on a shared machine; the summary repeats the comparison over the rounds whose both sides stayed
          under ``--quiet-below``, and gives the per-round ratios' mean with its standard error, also net of
          what the difference in other work between a round's two runs explains (least squares).
hook      The cost of one call of the optimizer-step hook (``runtime.auto.OptimizerSteps.on_optimizer_step``)
          in a worker that ``trainwarden run`` instrumented (its session's real TelemetryClient streaming to
          the real agent), called directly in a loop (less an empty call of the same shape), with an SGD
          optimizer (no step count in its state) and an AdamW one (a CPU step tensor: the index is read from
          it), and as torch calls it: ``optimizer.step()`` of a one-element SGD with the hook registered
          minus without it.
hang      The unchanged tutorial script (tests/fixtures/unchanged/ddp_tutorial.py, 2 ranks, steps of
          ~0.1 s: ``--sleep 0.1``) auto-instrumented; once it has trained ``--hang-after-steps`` steps and a
          random 0-1.5 s more (so the stop falls anywhere in the 1.5 s telemetry batch), one rank (found by
          RANK in /proc/<pid>/environ among the processes this script started; ranks alternate over trials)
          is SIGSTOPped. Measured from the SIGSTOP: the hang incident's ``detected_at``, and when the record
          naming that rank was first seen in the job's state directory (polled every 25 ms).

Every process this script starts (the launchers in sessions of their own, and everything below them, which
it tracks by pid and start time) is stopped when it ends, on Ctrl-C and on SIGTERM too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procs import stop_group  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TUTORIAL = REPO / "tests" / "fixtures" / "unchanged" / "ddp_tutorial.py"

JOB = '''\
"""An unchanged gloo DDP script (no trainwarden import): ~N ms of matmuls, a small DDP model, AdamW; it writes
the wall and CPU time of each of its steps to OUT/rank<R>.json."""
import argparse, json, os, time
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--repeats", type=int, required=True)
p.add_argument("--warmup-s", type=float, required=True)
p.add_argument("--steps", type=int, required=True)
p.add_argument("--out", required=True)
args = p.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
a = torch.randn(256, 256)
x, y = torch.randn(32, 64), torch.randn(32, 8)


def step():
    for _ in range(args.repeats):
        a @ a
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


t0 = time.perf_counter()
warmup = 0
done = torch.zeros(1)
while True:  # warm-up: until --warmup-s have passed on rank 0 (asked every 10 steps: the ranks must agree)
    step()
    warmup += 1
    if warmup % 10 == 0:
        done.fill_(float(time.perf_counter() - t0 >= args.warmup_s))
        dist.broadcast(done, 0)
        if done.item():
            break
rows = []
for _ in range(args.steps):
    w, c, pc = time.perf_counter(), time.thread_time(), time.process_time()
    step()
    rows.append((w - t0, time.perf_counter() - w, time.thread_time() - c, time.process_time() - pc))
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "rows": rows, "warmup_steps": warmup, "t0": t0}, f)  # t0: perf_counter, the
    # system's monotonic clock on Linux, which the benchmark's CPU sampler also reads
dist.destroy_process_group()
'''

# ---- processes ---------------------------------------------------------------------------------------------

_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start ticks) of ``pid``, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()
    return fields[0], int(fields[1]), int(fields[19])


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


class Family:
    """The processes below one root this script started: every descendant ever seen, named by pid and start
    ticks (pids are reused), so that what outlived its launcher can be killed, and nothing else."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, int] = {}

    def scan(self) -> list[int]:
        """The root's living descendants now (remembered)."""
        parents: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                stat = _stat(int(entry))
                if stat is not None and stat[0] not in ("Z", "X"):
                    parents.setdefault(stat[1], []).append(int(entry))
        found, frontier = [], [self.root]
        while frontier:
            children = [c for p in frontier for c in parents.get(p, ())]
            found += children
            frontier = children
        for pid in found:
            stat = _stat(pid)
            if stat is not None:
                self.seen.setdefault(pid, stat[2])
        return found

    def alive(self) -> list[int]:
        """Remembered descendants that still run (same pid, same start)."""
        out = []
        for pid, ticks in self.seen.items():
            stat = _stat(pid)
            if stat is not None and stat[2] == ticks and stat[0] not in ("Z", "X"):
                out.append(pid)
        return out

    def signal(self, sig: int) -> None:
        for pid in self.alive():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


_LIVE: list["Job"] = []


class Job:
    """One ``trainwarden run`` this script started, in a session of its own."""

    def __init__(self, root: Path, name: str, script: list[str], *, nproc: int = 2, auto: bool = True) -> None:
        self.name, self.home = name, root / name
        self.state_dir = self.home / "jobs" / name
        self.log_path = root / f"{name}.log"
        self.cmd = [sys.executable, "-m", "trainwarden.agent.cli", "run", "--nproc-per-node", str(nproc), "--job",
                    name, "--metrics-port", "0", "--state-home", str(self.home), "--max-restarts", "0",
                    *([] if auto else ["--no-auto-instrument"]), "--", *script]
        self.proc: subprocess.Popen | None = None
        self.family: Family | None = None

    def start(self) -> "Job":
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("TRAINWARDEN_") and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                                 "MASTER_PORT", "PYTHONPATH")}
        env.update(OMP_NUM_THREADS="1", TRAINWARDEN_STATE_HOME=str(self.home), PYTHONUNBUFFERED="1")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, cwd=self.home.parent)
        _LIVE.append(self)
        self.family = Family(self.proc.pid)
        if SAMPLER is not None:
            SAMPLER.jobs.append(self)
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.family.scan()
            time.sleep(0.5)
        return self.proc.poll()

    def worker(self, rank: int, script_name: str) -> int | None:
        """The pid of the worker of ``rank``: RANK in its environment, the script on its command line."""
        for pid in self.family.scan():
            if _environ(pid).get("RANK") == str(rank) and any(script_name in a for a in _cmdline(pid)):
                return pid
        return None

    def stop(self) -> None:
        """Stop the launcher's group (SIGTERM, then SIGKILL), then kill whatever of its family outlived it."""
        if self.proc is None:
            return
        try:
            self.family.scan()
            self.family.signal(signal.SIGCONT)  # a stopped worker cannot act on SIGTERM
            stop_group(self.proc, grace=15.0)
            for _ in range(20):
                if not self.family.alive():
                    break
                time.sleep(0.1)
            self.family.signal(signal.SIGKILL)
        finally:
            if self in _LIVE:
                _LIVE.remove(self)
            if SAMPLER is not None and self in SAMPLER.jobs:
                SAMPLER.jobs.remove(self)


class CpuSampler:
    """Samples, every ``period_s``, the machine's busy CPU time (/proc/stat) and that of the processes this
    benchmark runs (itself, its jobs' launchers and their families): the difference is other work on the
    machine, which on a shared machine is the main noise of a step time."""

    def __init__(self, period_s: float = 0.25) -> None:
        import threading

        self._period_s = period_s
        self._stop = threading.Event()
        self.samples: list[tuple[float, int, int]] = []  # (perf_counter, machine busy ticks, our ticks)
        self.jobs: list["Job"] = []
        self._thread = threading.Thread(target=self._run, name="bench-cpu-sampler", daemon=True)

    def __enter__(self) -> "CpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    @staticmethod
    def _busy() -> int:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields) - fields[3] - fields[4]  # all but idle and iowait (guest time is inside user)

    @staticmethod
    def _ticks(pid: int) -> int:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            return 0
        return int(fields[11]) + int(fields[12])

    def _run(self) -> None:
        while not self._stop.is_set():
            pids = {os.getpid()}
            for job in list(self.jobs):
                if job.proc is not None:
                    pids.add(job.proc.pid)
                    pids.update(job.family.seen)
            ours = sum(self._ticks(pid) for pid in pids)
            self.samples.append((time.perf_counter(), self._busy(), ours))
            self._stop.wait(self._period_s)

    def foreign_cores(self, start: float, end: float) -> float | None:
        """Mean CPU (in cores) that other work used between ``start`` and ``end`` (perf_counter times)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2 or inside[-1][0] - inside[0][0] < 1.0:
            return None
        (t0, busy0, ours0), (t1, busy1, ours1) = inside[0], inside[-1]
        return max(0.0, (busy1 - busy0) - (ours1 - ours0)) / _TICKS / (t1 - t0)


SAMPLER: CpuSampler | None = None


def _stop_everything() -> None:
    for job in list(_LIVE):
        try:
            job.stop()
        except Exception as exc:  # keep stopping the others
            print(f"cleanup of {job.name}: {exc}", file=sys.stderr)


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


# ---- part 1: step time with and without auto-instrumentation ---------------------------------------------------

def calibrate(step_ms: float) -> int:
    """256x256 matmuls for about ``step_ms`` of one thread's CPU: the fastest of 60 short tries, spread over a
    second or two, so that other work on a shared machine (which slows a matmul even in CPU time: the vCPUs
    share caches) is unlikely to be running during all of them."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    for _ in range(20):
        a @ a
    best = float("inf")
    for _ in range(60):
        t0 = time.thread_time()
        for _ in range(10):
            a @ a
        best = min(best, (time.thread_time() - t0) / 10)
        time.sleep(0.01)
    return max(1, round(step_ms / 1000 / best))


def summarize_steps(rank_rows: list[list]) -> dict:
    """Per-step statistics over the measured steps of every rank: rows of (start since the script's first
    step, wall, training thread CPU, process CPU), all in seconds."""
    walls, thread, off_cpu, background, started = [], [], [], [], []
    for rows in rank_rows:
        if not rows:
            raise ValueError("a rank measured no step")
        started.append(rows[0][0])
        for _, wall, thread_cpu, process_cpu in rows:
            walls.append(wall)
            thread.append(thread_cpu)
            off_cpu.append(wall - thread_cpu)
            background.append(process_cpu - thread_cpu)
    return {"median_s": statistics.median(walls), "mean_s": statistics.fmean(walls), "steps": len(walls),
            "p90_s": statistics.quantiles(walls, n=10)[-1] if len(walls) > 1 else walls[0],
            "thread_cpu_s": statistics.fmean(thread), "off_cpu_s": statistics.fmean(off_cpu),
            "background_cpu_s": statistics.fmean(background), "measured_from_s": min(started)}


def overhead_round(root: Path, index: int, auto: bool, repeats: int, steps: int, warmup_s: float) -> dict:
    side = "auto" if auto else "plain"
    out = root / f"steps-{index}-{side}"
    out.mkdir()
    job = Job(root, f"ovh{index}{side}", [str(root / "unchanged_matmul.py"), "--repeats", str(repeats),
                                           "--warmup-s", str(warmup_s), "--steps", str(steps), "--out",
                                           str(out)], auto=auto).start()
    try:
        rc = job.wait(timeout=600)
    finally:
        job.stop()
    log = job.log()
    if rc != 0:
        raise SystemExit(f"{job.name}: trainwarden run exited {rc}; its log:\n{log[-4000:]}")
    # the run summary says where steps came from: the hooks with instrumentation, nothing without
    hooked = "from optimizer hooks" in log
    if hooked != auto:
        raise SystemExit(f"{job.name}: expected auto-instrumentation {'on' if auto else 'off'}, the summary says "
                         f"otherwise:\n{log[-3000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    result = summarize_steps([r["rows"] for r in ranks])
    start = min(r["t0"] + r["rows"][0][0] for r in ranks)
    end = max(r["t0"] + r["rows"][-1][0] + r["rows"][-1][1] for r in ranks)
    foreign = SAMPLER.foreign_cores(start, end) if SAMPLER is not None else None
    result.update(side=side, round=index, warmup_steps=ranks[0]["warmup_steps"], load=os.getloadavg()[0],
                  foreign_cores=foreign)
    return result


def run_overhead(root: Path, args, repeats: int) -> dict:
    (root / "unchanged_matmul.py").write_text(JOB)
    results: dict[str, list[dict]] = {"auto": [], "plain": []}
    for index in range(args.rounds):
        order = (True, False) if index % 2 == 0 else (False, True)
        for auto in order:
            r = overhead_round(root, index, auto, repeats, args.measure_steps, args.warmup_s)
            results[r["side"]].append(r)
            print(f"overhead round {index} {r['side']:5s}: step median {r['median_s'] * 1e3:7.3f} ms  mean "
                  f"{r['mean_s'] * 1e3:7.3f} ms  p90 {r['p90_s'] * 1e3:7.3f} ms  training thread off CPU "
                  f"{r['off_cpu_s'] * 1e6:7.1f} us  its CPU {r['thread_cpu_s'] * 1e3:7.3f} ms  other threads' CPU "
                  f"{r['background_cpu_s'] * 1e6:6.1f} us  ({r['steps']} rank-steps from {r['measured_from_s']:.1f} s, "
                  f"after {r['warmup_steps']}); other work on the machine meanwhile "
                  f"{_cores(r['foreign_cores'])}", flush=True)
    return results


def _cores(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f} cores"


def overhead_report(results: dict, quiet_below: float) -> list[str]:
    lines = [f"all {len(results['auto'])} rounds:"]
    lines += ["  " + line for line in _overhead_lines(results["auto"], results["plain"])]
    quiet = [(a, p) for a, p in zip(results["auto"], results["plain"])
             if a["foreign_cores"] is not None and p["foreign_cores"] is not None
             and max(a["foreign_cores"], p["foreign_cores"]) < quiet_below]
    lines.append(f"the {len(quiet)} round(s) in which other work on the machine used under {quiet_below:g} cores "
                 f"during both sides' measured steps{':' if quiet else ''}")
    if quiet:
        lines += ["  " + line for line in _overhead_lines([a for a, _ in quiet], [p for _, p in quiet])]
    return lines


def _overhead_lines(auto: list[dict], plain: list[dict]) -> list[str]:
    lines = []
    step = statistics.median(r["median_s"] for r in plain)  # the % below are of the measured step
    for key, what in (("median_s", "median"), ("mean_s", "mean")):
        a = statistics.median(r[key] for r in auto)
        p = statistics.median(r[key] for r in plain)
        ratios = [x[key] / y[key] for x, y in zip(auto, plain)]  # round by round: the two sides run back to back
        spread = f"per round {min(ratios):.4f} .. {max(ratios):.4f}"
        if len(ratios) > 1:
            spread += f", stdev {statistics.stdev(ratios):.4f}"
        lines.append(f"step {what:6s} (median over rounds): auto {a * 1e3:.3f} ms, no-auto {p * 1e3:.3f} ms, "
                     f"ratio {a / p:.4f} ({(a / p - 1) * 100:+.2f} %, {(a - p) * 1e6:+.0f} us); "
                     f"median of per-round ratios {statistics.median(ratios):.4f}; {spread}")
    for key, what in (("thread_cpu_s", "training thread CPU"), ("off_cpu_s", "training thread off CPU"),
                      ("background_cpu_s", "other threads' CPU")):
        a = statistics.median(r[key] for r in auto)
        p = statistics.median(r[key] for r in plain)
        diffs = [(x[key] - y[key]) * 1e6 for x, y in zip(auto, plain)]
        lines.append(f"{what} per step: auto {a * 1e6:.1f} us, no-auto {p * 1e6:.1f} us, difference "
                     f"{(a - p) * 1e6:+.1f} us ({(a - p) / step * 100:+.3f} % of the {step * 1e3:.1f} ms step); "
                     f"per round {min(diffs):+.1f} .. {max(diffs):+.1f} us")
    paired = paired_effect(auto, plain)
    if paired is not None:
        mean, stderr, adjusted = paired
        lines.append(f"step median, paired by round (auto / no-auto - 1, the two runs of a round back to back): mean "
                     f"{mean * 100:+.2f} % +- {stderr * 100:.2f} % (1 s.e., {len(auto)} rounds)"
                     + ("" if adjusted is None else
                        f"; less what the difference in other work between the two runs explains (least squares "
                        f"on it): {adjusted[0] * 100:+.2f} % +- {adjusted[1] * 100:.2f} %"))
    return lines


def paired_effect(auto: list[dict], plain: list[dict]) -> tuple[float, float, tuple[float, float] | None] | None:
    """Round by round, the instrumented run's median step over the other's, less 1: their mean and its
    standard error, and, when the other work on the machine differed between the two runs of some rounds, the
    intercept of a least-squares line of those ratios on that difference (the ratio with no difference) and
    its standard error. None with fewer than 2 rounds."""
    import numpy as np

    ratios = np.array([a["median_s"] / p["median_s"] - 1 for a, p in zip(auto, plain)])
    n = len(ratios)
    if n < 2:
        return None
    mean, stderr = float(ratios.mean()), float(ratios.std(ddof=1) / np.sqrt(n))
    adjusted = None
    diffs = [None if a["foreign_cores"] is None or p["foreign_cores"] is None else a["foreign_cores"] - p["foreign_cores"]
             for a, p in zip(auto, plain)]
    if n >= 4 and None not in diffs and np.std(diffs) > 0.05:
        x = np.column_stack([np.ones(n), np.array(diffs, dtype=float)])
        coef, _, rank, _ = np.linalg.lstsq(x, ratios, rcond=None)
        if rank == 2:
            residual = ratios - x @ coef
            sigma2 = float(residual @ residual) / (n - 2)
            adjusted = (float(coef[0]), float(np.sqrt(sigma2 * np.linalg.inv(x.T @ x)[0, 0])))
    return mean, stderr, adjusted


# ---- part 2: one hook call -----------------------------------------------------------------------------------

def hook_child(out: str, calls: int, batches: int) -> None:
    """Runs as the worker of a ``trainwarden run`` job: times the instrumented process's own hook."""
    import weakref

    import torch
    import torch.distributed as dist
    import torch.optim.optimizer as optimizer_module

    dist.init_process_group("gloo")
    from trainwarden.runtime import auto

    steps = auto._steps
    session = steps.session if steps is not None else None
    client = session._client if session is not None else None
    if client is None:
        raise SystemExit("hook child: this worker was not auto-instrumented (no session with a client)")
    params = [torch.zeros(64, requires_grad=True) for _ in range(2)]
    sgd = torch.optim.SGD([params[0]], lr=0.1, momentum=0.9)
    adamw = torch.optim.AdamW([params[1]], lr=1e-3)
    for opt, p in ((sgd, params[0]), (adamw, params[1])):
        (p * 2).sum().backward()
        opt.step()  # the hooks count it; AdamW now keeps a CPU step tensor
    deadline = time.monotonic() + 15
    while client.sent == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    if client.sent == 0:
        raise SystemExit("hook child: the telemetry client sent nothing to the agent in 15 s")

    def per_call(fn, n_batches: int = batches) -> float:
        """Median over batches of one call's time in µs. Between batches the queue is handed to the sender, and
        the sender is given time to send it: its work would otherwise fall into the next batch (on another
        thread, but with the GIL)."""
        times = []
        for _ in range(n_batches):
            primary = steps._primary() if steps._primary is not None else None
            if primary is not None:  # one step between batches: the watchdog must not see a 5 s stall (a hang)
                hook(primary, (), {})
            client.flush(2.0)
            time.sleep(0.3)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) / calls * 1e6)
        return statistics.median(times)

    def noop(optimizer, args, kwargs):
        return None

    hook = steps.on_optimizer_step
    result = {"sent_before": client.sent, "dropped_before": client.dropped}
    result["empty_call_us"] = per_call(lambda: noop(sgd, (), {}))
    for name, opt in (("sgd", sgd), ("adamw", adamw)):
        steps._primary = weakref.ref(opt)
        result[f"{name}_call_us"] = per_call(lambda: hook(opt, (), {}))
    # as torch calls it: optimizer.step() with the hook registered, and with it taken out, alternating
    tiny = torch.zeros(1, requires_grad=True)
    tiny.grad = torch.zeros(1)
    opt = torch.optim.SGD([tiny], lr=0.0)
    steps._primary = weakref.ref(opt)
    hooks = optimizer_module._global_optimizer_post_hooks
    registered = dict(hooks)
    with_hook, without = [], []
    for _ in range(batches):
        with_hook.append(per_call(opt.step, 1))
        hooks.clear()
        try:
            without.append(per_call(opt.step, 1))
        finally:
            hooks.update(registered)
    result.update(step_with_hook_us=statistics.median(with_hook), step_without_hook_us=statistics.median(without),
                  registered_hooks=len(registered), dropped_after=client.dropped, sent_after=client.sent,
                  reconnects=client.reconnects, calls_per_batch=calls, batches=batches)
    Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def run_hook(root: Path, args) -> dict:
    out = root / "hook.json"
    job = Job(root, "hook", [str(Path(__file__).resolve()), "--child-hook", str(out), "--hook-calls",
                             str(args.hook_calls), "--hook-batches", str(args.hook_batches)], nproc=1).start()
    try:
        rc = job.wait(timeout=300)
    finally:
        job.stop()
    if rc != 0 or not out.exists():
        raise SystemExit(f"hook job: trainwarden run exited {rc}; its log:\n{job.log()[-4000:]}")
    result = json.loads(out.read_text())
    print(f"hook: empty call {result['empty_call_us']:.3f} us, on_optimizer_step SGD {result['sgd_call_us']:.3f} us, "
          f"AdamW {result['adamw_call_us']:.3f} us; optimizer.step() of one element with the hook "
          f"{result['step_with_hook_us']:.2f} us, without {result['step_without_hook_us']:.2f} us", flush=True)
    return result


def hook_report(result: dict, step_s: float) -> list[str]:
    """The hook's costs, also as a share of a step of ``step_s`` seconds."""
    step_ms = step_s * 1e3
    lines = []
    for name in ("sgd", "adamw"):
        net = result[f"{name}_call_us"] - result["empty_call_us"]
        lines.append(f"hook call, {name:5s}: {result[f'{name}_call_us']:.3f} us, less an empty call's "
                     f"{result['empty_call_us']:.3f} us = {net:.3f} us = {net / (step_ms * 1e3) * 100:.5f} % of a "
                     f"{step_ms:.1f} ms step")
    net = result["step_with_hook_us"] - result["step_without_hook_us"]
    lines.append(f"as torch calls it: optimizer.step() {result['step_with_hook_us']:.2f} us with the hook, "
                 f"{result['step_without_hook_us']:.2f} us without: {net:+.2f} us "
                 f"({net / (step_ms * 1e3) * 100:+.5f} % of a {step_ms:.1f} ms step)")
    lines.append(f"(each a median of {result['batches']} batches of {result['calls_per_batch']} calls; the "
                 f"client sent {result['sent_after']} messages, dropped {result['dropped_after']} records)")
    return lines


# ---- part 3: hang -> incident ------------------------------------------------------------------------------------

def _step_lines(log: str) -> int:
    return sum(1 for line in log.splitlines() if line.startswith("[") and "] loss=" in line)


def hang_trial(root: Path, index: int, rank: int, after_steps: int, rng: random.Random, bound: float) -> dict:
    from trainwarden.agent.incidents.store import list_incidents

    job = Job(root, f"hang{index}", [str(TUTORIAL), "--steps", "1000000", "--sleep", "0.1"]).start()
    result: dict = {"trial": index, "rank": rank}
    try:
        deadline = time.monotonic() + 180
        while _step_lines(job.log()) < after_steps:
            if job.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{job.name}: did not reach step {after_steps}; its log:\n{job.log()[-4000:]}")
            job.family.scan()
            time.sleep(0.2)
        jitter = rng.uniform(0.0, 1.5)
        time.sleep(jitter)
        pid = job.worker(rank, TUTORIAL.name)
        if pid is None:
            raise SystemExit(f"{job.name}: no process with RANK={rank} running {TUTORIAL.name} below the launcher")
        steps_before = _step_lines(job.log())
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.time()
        result.update(pid=pid, jitter_s=jitter, steps_before=steps_before)
        first_seen = named_seen = None
        incident, hangs = None, []
        while time.time() - stopped_at < bound:
            now = time.time()
            hangs = [i for i in list_incidents(job.home, job.name) if i.kind.value == "hang"]
            if hangs:
                if first_seen is None:
                    first_seen = now
                named = [i for i in hangs if rank in i.ranks]
                if named:
                    named_seen, incident = now, named[0]
                    break
            time.sleep(0.025)
        if incident is None:
            result.update(detected_s=None, seen_s=(first_seen - stopped_at) if first_seen else None,
                          ranks=list(hangs[0].ranks) if hangs else None)
        else:
            result.update(detected_s=incident.detected_at - stopped_at, seen_s=first_seen - stopped_at,
                          named_s=named_seen - stopped_at, ranks=list(incident.ranks),
                          deadline_s=incident.evidence.get("timeout_seconds"),
                          deadline=incident.evidence.get("deadline"), action=incident.action)
    finally:
        job.stop()
    return result


def run_hang(root: Path, args) -> list[dict]:
    rng = random.Random(args.seed)
    trials = []
    for index in range(args.hang_trials):
        r = hang_trial(root, index, index % 2, args.hang_after_steps, rng, args.hang_bound)
        trials.append(r)
        if r.get("detected_s") is None:
            print(f"hang trial {index}: SIGSTOP rank {r['rank']} (pid {r.get('pid')}): no hang incident naming it "
                  f"within {args.hang_bound:g} s (first hang record seen {r.get('seen_s')}, ranks {r.get('ranks')})",
                  flush=True)
        else:
            print(f"hang trial {index}: SIGSTOP rank {r['rank']} (pid {r['pid']}, {r['jitter_s']:.2f} s after step "
                  f"{args.hang_after_steps}) -> detected_at +{r['detected_s']:.2f} s, record naming rank {r['rank']} "
                  f"seen +{r['named_s']:.2f} s (ranks {r['ranks']}; deadline {r['deadline_s']} s, "
                  f"{r['deadline']}; action {r['action']})", flush=True)
    return trials


def hang_report(trials: list[dict], target: float = 10.0) -> list[str]:
    ok = [t for t in trials if t.get("detected_s") is not None]
    lines = []
    if ok:
        detected = [t["detected_s"] for t in ok]
        named = [t["named_s"] for t in ok]
        lines.append(f"SIGSTOP -> incident detected_at: median {statistics.median(detected):.2f} s, range "
                     f"{min(detected):.2f} .. {max(detected):.2f} s; -> record naming the stopped rank seen: median "
                     f"{statistics.median(named):.2f} s, range {min(named):.2f} .. {max(named):.2f} s "
                     f"({len(ok)} of {len(trials)} trials; target <= {target:g} s: "
                     f"{'met' if max(named) <= target else 'NOT met'} in every trial that detected)")
        wrong = [t for t in ok if t["ranks"] != [t["rank"]]]
        if wrong:
            lines.append(f"records naming more than the stopped rank: {[(t['rank'], t['ranks']) for t in wrong]}")
    missed = len(trials) - len(ok)
    if missed:
        lines.append(f"{missed} trial(s) without a hang incident naming the stopped rank")
    return lines


# ---- main ---------------------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="overhead,hook,hang", help="parts to run, comma-separated (default: all)")
    ap.add_argument("--rounds", type=int, default=8, help="overhead: rounds, each one run of each side")
    ap.add_argument("--step-ms", type=float, default=50.0, help="overhead: CPU work per step (default 50)")
    ap.add_argument("--warmup-s", type=float, default=13.0,
                    help="overhead: seconds of steps not measured at the start of each run (default 13: past the "
                         "agent's 10 s before it paces a quiet job's Flight Recorder reads)")
    ap.add_argument("--measure-steps", type=int, default=300, help="overhead: measured steps per run (default 300)")
    ap.add_argument("--quiet-below", type=float, default=0.1,
                    help="overhead: also report the rounds in which other work on the machine used fewer cores than "
                         "this during both sides' measured steps (default 0.1)")
    ap.add_argument("--hook-calls", type=int, default=2000, help="hook: calls per timed batch (default 2000)")
    ap.add_argument("--hook-batches", type=int, default=20, help="hook: timed batches (default 20)")
    ap.add_argument("--hang-trials", type=int, default=6, help="hang: trials, the stopped rank alternating (default 6)")
    ap.add_argument("--hang-after-steps", type=int, default=50,
                    help="hang: steps the job trains before the stop (default 50)")
    ap.add_argument("--hang-bound", type=float, default=60.0, help="hang: seconds to wait for the incident")
    ap.add_argument("--seed", type=int, default=24, help="hang: seed of the stop's random delay")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, state) and print it")
    ap.add_argument("--json", action="store_true", help="also print every result as one JSON line")
    ap.add_argument("--child-hook", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_hook:
        hook_child(args.child_hook, args.hook_calls, args.hook_batches)
        return
    parts = {p.strip() for p in args.only.split(",") if p.strip()}
    unknown = parts - {"overhead", "hook", "hang"}
    if unknown:
        ap.error(f"--only: unknown part(s) {sorted(unknown)}")
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGHUP, _interrupted)
    root = Path(tempfile.mkdtemp(prefix="tw-bench-auto-"))
    started = time.time()
    global SAMPLER
    SAMPLER = CpuSampler().__enter__()
    out: dict = {}
    repeats = 0
    try:
        print(f"machine: {os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
              f"work directory {root}", flush=True)
        if parts & {"overhead", "hook"}:
            repeats = calibrate(args.step_ms)
            print(f"{repeats} matmuls (256x256) per step for ~{args.step_ms:g} ms of one thread's CPU", flush=True)
        if "overhead" in parts:
            out["overhead"] = run_overhead(root, args, repeats)
        if "hook" in parts:
            out["hook"] = run_hook(root, args)
        if "hang" in parts:
            out["hang"] = run_hang(root, args)
    except KeyboardInterrupt:
        print("interrupted: stopping every process this script started", file=sys.stderr, flush=True)
        raise SystemExit(130)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        _stop_everything()
        SAMPLER.__exit__(None, None, None)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if args.keep:
            print(f"kept {root}")
        else:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
    print(f"\nsummary ({(time.time() - started) / 60:.1f} min, load average now "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    if "overhead" in out:
        print(f"overhead: 2 ranks, {repeats} matmuls + a small DDP model + AdamW per step, {args.rounds} rounds x "
              f"{args.measure_steps} measured steps per rank (after {args.warmup_s:g} s) per side")
        for line in overhead_report(out["overhead"], args.quiet_below):
            print("  " + line)
    if "hook" in out:
        print("hook:")
        step_s = (statistics.median(r["median_s"] for r in out["overhead"]["plain"]) if "overhead" in out
                  else args.step_ms / 1e3)  # the measured step when there is one
        for line in hook_report(out["hook"], step_s):
            print("  " + line)
    if "hang" in out:
        print(f"hang: {TUTORIAL.name}, 2 ranks, 0.1 s steps, {args.hang_trials} trials")
        for line in hang_report(out["hang"]):
            print("  " + line)
    if args.json:
        print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()

"""Per-step overhead of trainwarden telemetry: `rt.step` + the sender thread + Flight Recorder reads.

    python tests/bench/bench_telemetry.py [--steps 100] [--rounds 3] [--step-ms 50] [--device cuda] [--json OUT]
                                          [--before CHECKOUT]

Each mode runs in its own process (so no background thread of another mode competes), and the modes are
interleaved over several rounds to spread machine noise evenly:

    baseline  the training loop alone
    alive     rt.step around each step, streaming to an agent (a TelemetryServer in another process)
    alive-nofr  the same with the Flight Recorder off (TORCH_FR_BUFFER_SIZE=0): the stream's share alone
    absent    rt.step with TRAINWARDEN_AGENT_SOCKET pointing at no agent (drop + reconnect path)
    alive-before  with ``--before CHECKOUT``: alive, with the runtime of another checkout of trainwarden (a
              ``git worktree`` of the commit before a change), so a change is measured in the same run

The loop is a single-threaded matmul loop sized to about --step-ms per step, plus one gloo all_reduce in
a world of one (so the Flight Recorder has entries to read). With ``--device cuda`` (`make gpu-check`) the step
is a ``torch.cuda._sleep`` kernel of about --step-ms, one NCCL all_reduce in a world of one and a synchronize
(as a loss.item() does); rt.step then times the step with CUDA events (runtime/cuda_timing.py) and the Flight
Recorder read is NCCL's. ``--json OUT`` also writes the figures. All modes run with FLIGHT_RECORDER_ENV set:
recording is torch's cost and the launcher turns it on regardless (``--ring N`` sets its size, default
the launcher's). Reported:

- median wall time and process CPU time per step against baseline (noisy on a shared machine);
- CPU time of the background threads (sender, gRPC) per step, from process minus training-thread CPU
  time within one run, less baseline's (gloo's own threads): robust to a busy machine;
- the hot path alone (`with rt.step(): pass` in a tight loop);
- the overhead estimate = hot path + background CPU, as µs and % of the step;
- the training thread's lost time: its time off the CPU per step (wall minus its own CPU time: waiting
  for the GIL a Flight Recorder dump holds, or preempted), less baseline's;
- one Flight Recorder read of a full ring (TORCH_FR_BUFFER_SIZE entries). The ring is filled before
  the measured steps in every mode, so each periodic read in the run costs as much as in a long job.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

AGENT = """  # argv: socket, state directory, quiet read period ("": WatchdogConfig's); TRAINWARDEN_QUIET_STEP_SEND_S in the
# environment: the held steps' period (WatchdogConfig's 2 s when unset; 0: off)
import os, sys, time
from pathlib import Path
from trainwarden.agent.incidents.store import IncidentStore
from trainwarden.agent.node.actions import AgentActions
from trainwarden.agent.telemetry.job_telemetry import JobTelemetry
from trainwarden.agent.telemetry.server import TelemetryServer
from trainwarden.agent.watchdog.interface import WatchdogConfig
from trainwarden.agent.watchdog.loop import Watchdog
js = JobTelemetry()
server = TelemetryServer(sys.argv[1], js)
server.start()
state = Path(sys.argv[2])
actions = AgentActions(server, js, IncidentStore(state_dir=lambda job: state / job), node="bench")
send = float(os.environ.get("TRAINWARDEN_QUIET_STEP_SEND_S") or WatchdogConfig.quiet_step_send_s)  # held steps
config = WatchdogConfig(quiet_read_period_s=float(sys.argv[3]) if sys.argv[3] else WatchdogConfig.quiet_read_period_s,
                        quiet_step_send_s=send)
Watchdog(js, actions, config=config, node="bench", diagnostics_dir=lambda job: state / job / "diagnostics").start()
print("serving", flush=True)
time.sleep(3600)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def calibrate(step_ms: float) -> int:
    """Matmuls per step for about `step_ms` (fastest of several tries: the machine may be busy)."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    best = float("inf")
    for _ in range(5):  # CPU time, not wall time: other processes on the machine do not count
        t0 = time.thread_time()
        for _ in range(50):
            a @ a
        best = min(best, (time.thread_time() - t0) / 50)
    return max(1, round(step_ms / 1000 / best))


def _runqueue_wait_s() -> float:
    """The calling thread's time ready to run but waiting for a CPU (Linux schedstat; 0 elsewhere)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _threads_cpu_s() -> dict[str, float]:
    """CPU seconds of each thread of this process (Linux schedstat), keyed by its Python name where it has one
    (the telemetry sender, gRPC's Python threads), else by its kernel name (gloo's and gRPC's native threads)."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    found: dict[str, float] = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                ran_ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{task}/comm") as f:
                comm = f.read().strip()
        except (OSError, IndexError, ValueError):
            continue  # the thread ended
        name = names.get(int(task)) or f"native:{comm}"
        found[name] = found.get(name, 0.0) + ran_ns / 1e9
    return found


def calibrate_cuda(step_ms: float) -> int:
    """`torch.cuda._sleep` cycles for about `step_ms` on this GPU (timed with CUDA events)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # warm up the clocks
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return max(1, round(cycles * step_ms / start.elapsed_time(end)))


def child(mode: str, steps: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    import trainwarden.runtime

    torch.set_num_threads(1)
    cuda = os.environ.get("BENCH_DEVICE") == "cuda"
    if cuda:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    device = "cuda" if cuda else "cpu"
    a = torch.randn(256, 256)
    grad = torch.ones(1000, device=device)
    small = torch.ones(1, device=device)
    for _ in range(int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0"))):  # steady state: the ring is full
        dist.all_reduce(small)
    rt = trainwarden.runtime.init(job="bench", **json.loads(os.environ.get("BENCH_CLIENT_OPTIONS", "{}")))

    def one_step(i):
        if cuda:
            torch.cuda._sleep(repeats)
            dist.all_reduce(grad)
            torch.cuda.synchronize()
            return
        for _ in range(repeats):
            a @ a
        dist.all_reduce(grad)

    for i in range(20):  # warm up (and connect)
        with rt.step(i, tokens=1):
            one_step(i)
    client = getattr(rt, "_client", None)
    if mode.startswith("alive") and client is not None:
        # the steady state: the agent's watchdog asks a job that no detector is near a decision on to read its
        # Flight Recorder slowly (WatchdogConfig.quiet_after_s after it first sees it)
        deadline, i = time.monotonic() + 20, 20
        while client._schedule.interval_s == client.config.fr_interval_s and time.monotonic() < deadline:
            with rt.step(i, tokens=1):
                one_step(i)
            i += 1
    threads0 = _threads_cpu_s()
    walls, cpu0, main0, queued0 = [], time.process_time(), time.thread_time(), _runqueue_wait_s()
    for i in range(20, 20 + steps):
        w0 = time.perf_counter()
        if mode == "baseline":
            one_step(i)
        else:
            with rt.step(i, tokens=1):
                one_step(i)
        walls.append(time.perf_counter() - w0)
    cpu = (time.process_time() - cpu0) / steps
    main_cpu = (time.thread_time() - main0) / steps
    queued = (_runqueue_wait_s() - queued0) / steps
    threads = {name: (cpu_s - threads0.get(name, 0.0)) / steps for name, cpu_s in _threads_cpu_s().items()}
    background = cpu - main_cpu  # CPU of every thread but the training thread
    result = {"mode": mode, "wall_median_s": statistics.median(walls), "wall_mean_s": statistics.fmean(walls),
              "cpu_per_step_s": cpu, "background_cpu_per_step_s": background,
              # the training thread's time off the CPU: waiting for the GIL (a Flight Recorder dump holds it),
              # or preempted; less baseline's, the time the watching took from training
              "off_cpu_per_step_s": statistics.fmean(walls) - main_cpu,
              # of which ready to run but not running (preempted by another thread or process); the rest it
              # was blocked: in gloo, or waiting for the GIL
              "runqueue_per_step_s": queued,
              "threads_cpu_per_step_s": {k: v for k, v in threads.items() if v > 0 and k != "MainThread"},
              "stats": rt.stats, "read_pace_s": client._schedule.interval_s if client is not None else None}
    if mode == "alive":
        n = 100_000
        t0 = time.perf_counter()
        for i in range(n):
            with rt.step(i):
                pass
        result["hot_path_us"] = (time.perf_counter() - t0) / n * 1e6
        from trainwarden.runtime.flight_recorder import FlightRecorder

        fr = FlightRecorder()
        t0 = time.perf_counter()
        entries = fr.read_new()
        result["fr_full_read_s"] = time.perf_counter() - t0
        result["fr_entries"] = len(entries)
        result["fr_recorders"] = sorted({e.get("recorder", "") for e in entries})
        timer = getattr(rt, "_cuda", None)
        result["gpu_timed_steps"] = timer.resolved if timer is not None else 0
    rt.close()
    dist.destroy_process_group()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--ring", type=int, default=None,
                        help="Flight Recorder ring size (TORCH_FR_BUFFER_SIZE); default: what the launcher sets")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                        help="also run an alive mode named NAME with these client options (ClientConfig fields, "
                             "e.g. slow:fr_interval_s=3,flush_interval_s=1.5); repeatable")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: a GPU step (torch.cuda._sleep) over NCCL, timed with CUDA events")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--modes", default=None, metavar="MODE[,MODE]",
                        help="run only these of baseline, alive, alive-nofr, absent (baseline and alive always run; "
                             "variants and alive-before are added to them)")
    parser.add_argument("--before", default=None, metavar="CHECKOUT",
                        help="also run alive-before: the alive mode with the runtime of this trainwarden checkout")
    parser.add_argument("--quiet-read-s", default=None, metavar="S[,S]",
                        help="also run an alive mode per value, alive-quietS, against an agent of its own that asks "
                             "for this read period while no detector is near a decision "
                             "(WatchdogConfig.quiet_read_period_s; alive's agent asks for its default)")
    parser.add_argument("--child")
    parser.add_argument("--repeats", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    variants: dict[str, dict] = {}
    for spec in args.variant:
        name, _, options = spec.partition(":")
        try:
            variants[name] = {k: json.loads(v) for k, v in (o.split("=", 1) for o in options.split(",") if o)}
        except ValueError:
            parser.error(f"--variant {spec!r}: expected NAME:KEY=VALUE[,KEY=VALUE] with JSON values")
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.steps, args.repeats)), flush=True)
        return

    from trainwarden.runtime.flight_recorder import FLIGHT_RECORDER_ENV

    repeats = calibrate_cuda(args.step_ms) if args.device == "cuda" else calibrate(args.step_ms)
    quiet = {f"alive-quiet{q:g}": q for q in (float(v) for v in (args.quiet_read_s or "").split(",") if v)}
    tmp = Path(tempfile.mkdtemp(prefix="tw-bench-"))
    agents = []
    try:
        for name, period in {"alive": None, **quiet}.items():  # one agent each: the pace is the agent's to ask
            agents.append(subprocess.Popen([sys.executable, "-c", AGENT, str(tmp / f"{name}.sock"),
                                            str(tmp / f"{name}-state"), "" if period is None else str(period)],
                                           stdout=subprocess.PIPE, text=True, start_new_session=True))
            assert agents[-1].stdout.readline().strip() == "serving"
        sock = tmp / "alive.sock"
        modes = {"baseline", "alive", *(args.modes.split(",") if args.modes else ("alive-nofr", "absent"))}
        results: dict[str, list[dict]] = {m: [] for m in ("baseline", "alive", "alive-nofr", "absent") if m in modes}
        variant_of = {f"alive-{name}": options for name, options in variants.items()}
        results.update((mode, []) for mode in variant_of)
        results.update((mode, []) for mode in quiet)
        if args.before:
            shim = tmp / "before"  # `trainwarden` there is the other checkout: found before the installed one
            shim.mkdir()
            (shim / "trainwarden").symlink_to(Path(args.before).resolve())
            results["alive-before"] = []
        for round_ in range(args.rounds):
            for mode in results:
                env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port()), BENCH_DEVICE=args.device, **FLIGHT_RECORDER_ENV)
                if args.ring is not None:
                    env["TORCH_FR_BUFFER_SIZE"] = str(args.ring)
                env.pop("TRAINWARDEN_AGENT_SOCKET", None)
                if mode.startswith("alive"):
                    env["TRAINWARDEN_AGENT_SOCKET"] = str(sock)
                if mode == "alive-nofr":
                    env["TORCH_FR_BUFFER_SIZE"] = "0"
                elif mode == "absent":
                    env["TRAINWARDEN_AGENT_SOCKET"] = str(tmp / "nobody.sock")
                elif mode in quiet:
                    env["TRAINWARDEN_AGENT_SOCKET"] = str(tmp / f"{mode}.sock")
                elif mode in variant_of:
                    env["BENCH_CLIENT_OPTIONS"] = json.dumps(variant_of[mode])
                elif mode == "alive-before":
                    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp / "before"), env.get("PYTHONPATH")]))
                child_mode = "alive" if mode in variant_of or mode in quiet or mode == "alive-before" else mode
                out = subprocess.run([sys.executable, __file__, "--child", child_mode, "--steps", str(args.steps),
                                      "--repeats", str(repeats)], env=env, capture_output=True,
                                     text=True, timeout=600, start_new_session=True)
                line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                if not line:
                    raise SystemExit(f"{mode} child failed:\n{out.stderr[-3000:]}")
                results[mode].append(json.loads(line[0][7:]))
                print(f"round {round_} {mode:10s} wall {results[mode][-1]['wall_median_s'] * 1e3:8.3f} ms  "
                      f"cpu {results[mode][-1]['cpu_per_step_s'] * 1e3:8.3f} ms  background cpu "
                      f"{results[mode][-1]['background_cpu_per_step_s'] * 1e6:7.1f} us  training thread off "
                      f"CPU {results[mode][-1]['off_cpu_per_step_s'] * 1e6:7.1f} us (in the run queue "
                      f"{results[mode][-1]['runqueue_per_step_s'] * 1e6:5.1f} us)", flush=True)
    finally:
        for agent in agents:
            os.killpg(agent.pid, 9)
            agent.wait()
        shutil.rmtree(tmp, ignore_errors=True)  # the agent's socket and state: nothing left in /tmp

    base_wall = statistics.median(r["wall_median_s"] for r in results["baseline"])
    base_cpu = statistics.median(r["cpu_per_step_s"] for r in results["baseline"])
    print(f"\n{repeats} {'torch.cuda._sleep cycles' if args.device == 'cuda' else 'matmuls (256x256)'} per step")
    figures: dict = {"device": args.device, "step_ms_asked": args.step_ms, "baseline_wall_s": base_wall,
                     "modes": {}}
    print(f"baseline: {base_wall * 1e3:.3f} ms/step wall, {base_cpu * 1e3:.3f} ms/step CPU "
          f"({args.rounds} rounds x {args.steps} steps, median of medians)")
    others = [m for m in results if m != "baseline"]
    for mode in others:
        wall = statistics.median(r["wall_median_s"] for r in results[mode])
        cpu = statistics.median(r["cpu_per_step_s"] for r in results[mode])
        print(f"{mode:7s}: wall {wall * 1e3:.3f} ms/step  overhead {(wall - base_wall) * 1e6:+8.1f} us "
              f"({(wall / base_wall - 1) * 100:+.2f} %)   cpu overhead {(cpu - base_cpu) * 1e6:+8.1f} us/step "
              f"({(cpu / base_cpu - 1) * 100:+.2f} %)   client {results[mode][-1]['stats']}, read pace {results[mode][-1].get('read_pace_s')} s")
        figures["modes"][mode] = {"wall_s": wall, "overhead_pct": (wall / base_wall - 1) * 100,
                                  "cpu_overhead_us": (cpu - base_cpu) * 1e6}
    base_bg = statistics.median(r["background_cpu_per_step_s"] for r in results["baseline"])
    alive = results["alive"]
    hot = statistics.median(r["hot_path_us"] for r in alive)
    base_off = statistics.median(r["off_cpu_per_step_s"] for r in results["baseline"])
    base_queued = statistics.median(r["runqueue_per_step_s"] for r in results["baseline"])
    for mode in others:
        bg = statistics.median(r["background_cpu_per_step_s"] for r in results[mode]) - base_bg
        lost = statistics.median(r["off_cpu_per_step_s"] for r in results[mode]) - base_off
        total = bg + hot / 1e6
        print(f"{mode:10s}: background threads {bg * 1e6:+8.1f} us CPU/step; with the hot path "
              f"{total * 1e6:8.1f} us/step = {total / base_cpu * 100:.3f} % of the step's "
              f"{base_cpu * 1e3:.1f} ms CPU ({total / base_wall * 100:.3f} % of its {base_wall * 1e3:.1f} ms wall); "
              f"training thread lost {lost * 1e6:+7.1f} us/step ({lost / base_wall * 100:+.3f} %; in the run queue "
              f"{(statistics.median(r['runqueue_per_step_s'] for r in results[mode]) - base_queued) * 1e6:+6.1f} us)")
    for mode in others:  # where the background CPU goes (clock ticks: coarse, a median over rounds)
        names = sorted({n for r in results[mode] for n in r.get("threads_cpu_per_step_s", {})})
        shares = {n: statistics.median(r.get("threads_cpu_per_step_s", {}).get(n, 0.0) for r in results[mode])
                  for n in names}
        print(f"{mode:10s}: threads' CPU/step " + ", ".join(f"{n} {v * 1e6:.0f} us" for n, v in
                                                          sorted(shares.items(), key=lambda kv: -kv[1]) if v))
    print(f"hot path (with rt.step(): pass): {hot:.2f} us/step")
    from trainwarden.runtime.agent_client import ClientConfig

    fr_cost = statistics.median(r["fr_full_read_s"] for r in alive)
    defaults = ClientConfig(socket_path="-")
    paced = alive[-1].get("read_pace_s") or defaults.fr_interval_s
    interval = max(paced, fr_cost / defaults.fr_max_duty)
    print(f"flight recorder read of a full ring ({alive[-1]['fr_entries']} entries): {fr_cost * 1e3:.1f} ms; "
          f"at the agent's read pace ({paced:g} s) one read every {interval:.1f} s = "
          f"{fr_cost / interval * base_wall * 1e6:.1f} us/step amortized (may fall outside the measured steps)")
    figures.update(hot_path_us=hot, fr_full_read_s=fr_cost, fr_entries=alive[-1]["fr_entries"],
                   fr_recorders=alive[-1].get("fr_recorders"), gpu_timed_steps=alive[-1].get("gpu_timed_steps"))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()

"""Per-step overhead of trainwarden telemetry: `rt.step` + the sender thread + Flight Recorder reads.

    python tests/bench/bench_telemetry.py [--steps 100] [--rounds 3] [--step-ms 50]

Each mode runs in its own process (so no background thread of another mode competes), and the modes are
interleaved over several rounds to spread machine noise evenly:

    baseline  the training loop alone
    alive     rt.step around each step, streaming to an agent (a TelemetryServer in another process)
    alive-nofr  the same with the Flight Recorder off (TORCH_FR_BUFFER_SIZE=0): the stream's share alone
    absent    rt.step with TRAINWARDEN_AGENT_SOCKET pointing at no agent (drop + reconnect path)

The loop is a single-threaded matmul loop sized to about --step-ms per step, plus one gloo all_reduce in
a world of one (so the Flight Recorder has entries to read). All modes run with FLIGHT_RECORDER_ENV set:
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
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

AGENT = """
import sys, time
from trainwarden.agent.telemetry.job_telemetry import JobTelemetry
from trainwarden.agent.telemetry.server import TelemetryServer
TelemetryServer(sys.argv[1], JobTelemetry()).start()
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


def child(mode: str, steps: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    import trainwarden.runtime

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    a = torch.randn(256, 256)
    grad = torch.ones(1000)
    small = torch.ones(1)
    for _ in range(int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0"))):  # steady state: the ring is full
        dist.all_reduce(small)
    rt = trainwarden.runtime.init(job="bench")

    def one_step(i):
        for _ in range(repeats):
            a @ a
        dist.all_reduce(grad)

    for i in range(20):  # warm up (and connect)
        with rt.step(i, tokens=1):
            one_step(i)
    walls, cpu0, main0 = [], time.process_time(), time.thread_time()
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
    background = cpu - main_cpu  # CPU of every thread but the training thread
    result = {"mode": mode, "wall_median_s": statistics.median(walls), "wall_mean_s": statistics.fmean(walls),
              "cpu_per_step_s": cpu, "background_cpu_per_step_s": background,
              # the training thread's time off the CPU: waiting for the GIL (a Flight Recorder dump holds it),
              # or preempted; less baseline's, the time the watching took from training
              "off_cpu_per_step_s": statistics.fmean(walls) - main_cpu,
              "stats": rt.stats}
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
    parser.add_argument("--child", choices=["baseline", "alive", "alive-nofr", "absent"])
    parser.add_argument("--repeats", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.steps, args.repeats)), flush=True)
        return

    from trainwarden.runtime.flight_recorder import FLIGHT_RECORDER_ENV

    repeats = calibrate(args.step_ms)
    tmp = Path(tempfile.mkdtemp(prefix="tw-bench-"))
    sock = tmp / "agent.sock"
    agent = subprocess.Popen([sys.executable, "-c", AGENT, str(sock)], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        assert agent.stdout.readline().strip() == "serving"
        results: dict[str, list[dict]] = {"baseline": [], "alive": [], "alive-nofr": [], "absent": []}
        for round_ in range(args.rounds):
            for mode in results:
                env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port()), **FLIGHT_RECORDER_ENV)
                if args.ring is not None:
                    env["TORCH_FR_BUFFER_SIZE"] = str(args.ring)
                env.pop("TRAINWARDEN_AGENT_SOCKET", None)
                if mode.startswith("alive"):
                    env["TRAINWARDEN_AGENT_SOCKET"] = str(sock)
                if mode == "alive-nofr":
                    env["TORCH_FR_BUFFER_SIZE"] = "0"
                elif mode == "absent":
                    env["TRAINWARDEN_AGENT_SOCKET"] = str(tmp / "nobody.sock")
                out = subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(args.steps),
                                      "--repeats", str(repeats)], env=env, capture_output=True,
                                     text=True, timeout=600, start_new_session=True)
                line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                if not line:
                    raise SystemExit(f"{mode} child failed:\n{out.stderr[-3000:]}")
                results[mode].append(json.loads(line[0][7:]))
                print(f"round {round_} {mode:10s} wall {results[mode][-1]['wall_median_s'] * 1e3:8.3f} ms  "
                      f"cpu {results[mode][-1]['cpu_per_step_s'] * 1e3:8.3f} ms  background cpu "
                      f"{results[mode][-1]['background_cpu_per_step_s'] * 1e6:7.1f} us  training thread off "
                      f"CPU {results[mode][-1]['off_cpu_per_step_s'] * 1e6:7.1f} us", flush=True)
    finally:
        os.killpg(agent.pid, 9)
        agent.wait()

    base_wall = statistics.median(r["wall_median_s"] for r in results["baseline"])
    base_cpu = statistics.median(r["cpu_per_step_s"] for r in results["baseline"])
    print(f"\n{repeats} matmuls (256x256) per step")
    print(f"baseline: {base_wall * 1e3:.3f} ms/step wall, {base_cpu * 1e3:.3f} ms/step CPU "
          f"({args.rounds} rounds x {args.steps} steps, median of medians)")
    for mode in ("alive", "alive-nofr", "absent"):
        wall = statistics.median(r["wall_median_s"] for r in results[mode])
        cpu = statistics.median(r["cpu_per_step_s"] for r in results[mode])
        print(f"{mode:7s}: wall {wall * 1e3:.3f} ms/step  overhead {(wall - base_wall) * 1e6:+8.1f} us "
              f"({(wall / base_wall - 1) * 100:+.2f} %)   cpu overhead {(cpu - base_cpu) * 1e6:+8.1f} us/step "
              f"({(cpu / base_cpu - 1) * 100:+.2f} %)   client {results[mode][-1]['stats']}")
    base_bg = statistics.median(r["background_cpu_per_step_s"] for r in results["baseline"])
    alive = results["alive"]
    hot = statistics.median(r["hot_path_us"] for r in alive)
    base_off = statistics.median(r["off_cpu_per_step_s"] for r in results["baseline"])
    for mode in ("alive", "alive-nofr", "absent"):
        bg = statistics.median(r["background_cpu_per_step_s"] for r in results[mode]) - base_bg
        lost = statistics.median(r["off_cpu_per_step_s"] for r in results[mode]) - base_off
        total = bg + hot / 1e6
        print(f"{mode:10s}: background threads {bg * 1e6:+8.1f} us CPU/step; with the hot path "
              f"{total * 1e6:8.1f} us/step = {total / base_cpu * 100:.3f} % of the step's "
              f"{base_cpu * 1e3:.1f} ms CPU ({total / base_wall * 100:.3f} % of its {base_wall * 1e3:.1f} ms wall); "
              f"training thread lost {lost * 1e6:+7.1f} us/step ({lost / base_wall * 100:+.3f} %)")
    print(f"hot path (with rt.step(): pass): {hot:.2f} us/step")
    from trainwarden.runtime.agent_client import ClientConfig

    fr_cost = statistics.median(r["fr_full_read_s"] for r in alive)
    defaults = ClientConfig(socket_path="-")
    interval = max(defaults.fr_interval_s, fr_cost / defaults.fr_max_duty)
    print(f"flight recorder read of a full ring ({alive[-1]['fr_entries']} entries): {fr_cost * 1e3:.1f} ms; "
          f"with the default interval rule one read every {interval:.1f} s = "
          f"{fr_cost / interval * base_wall * 1e6:.1f} us/step amortized (may fall outside the measured steps)")


if __name__ == "__main__":
    main()

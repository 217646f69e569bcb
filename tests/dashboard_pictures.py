"""`make dashboard-pictures`: the pictures of the Grafana dashboards in docs/OPERATIONS.md, drawn from a real run.

    python tests/dashboard_pictures.py [--out docs/img] [--steps 160] [--faults SPEC] [--workdir DIR]

The set-up of tests/integration/test_prometheus.py, with faults injected: a real Prometheus on loopback scrapes
`trainwarden run` of the 8-rank reference job (CPU, gloo, pp 2 x tp 2 x dp 2) and a node agent's GPU and host
collectors on a fake NVML (tests/fake_nvml.py; see GpuStory), every second. By default rank 6
runs at half speed for a while (a straggler) and rank 5 crashes later (an incident, a restart from the latest
checkpoint), so that the straggler panels and the annotations have something to show. When the job has ended,
dashboards/render.py draws both dashboards over the run from Prometheus's data into dashboard-job.png and
dashboard-node.png. Everything it started (Prometheus, the job, the exporter) is stopped when it ends, Ctrl-C
included; logs stay in the work directory.
"""

from __future__ import annotations

import argparse
import math
import shutil
import signal
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(HERE / "integration"), str(ROOT)]
from dashboards import render  # noqa: E402
from dashboards.queries import PrometheusClient  # noqa: E402
from fake_nvml import FakeGpu, FakeNvml, gpu_node_exporter  # noqa: E402
from gpt_helpers import gpt_env  # noqa: E402
from local_prometheus import available, query, start_prometheus  # noqa: E402
from procs import ProcessGroup, wait_for  # noqa: E402
from trainwarden.agent.etcd.embedded import free_port  # noqa: E402

FAULTS = "slow:rank=6,from=30,until=80,factor=2;crash:rank=5,step=110"
"""A 2x straggler on rank 6 for 50 steps, then a crash of rank 5 (the job restarts from step 110's checkpoint)."""
JOB = "gpt-demo"
BOARDS = [ROOT / "dashboards" / "grafana" / "job.json", ROOT / "dashboards" / "grafana" / "node.json"]


class GpuStory:
    """What the node dashboard's GPU panels show, there being no GPU here: two fake GPUs whose readings move as a
    busy GPU's do (utilization, power, a temperature that climbs into thermal slowdown on GPU 0, a corrected ECC
    error now and then), until GPU 1 falls off the bus (XID 79, an uncorrected ECC error) ``fault_at_s`` into
    the run."""

    THERMAL_SLOWDOWN, POWER_CAP = 0x40, 0x4

    def __init__(self, fault_at_s: float) -> None:
        self.nvml = FakeNvml([FakeGpu(uuid="GPU-aaaa", clock_reasons=0, ecc_corrected=0, pcie_replays=0),
                              FakeGpu(uuid="GPU-bbbb", clock_reasons=0, ecc_corrected=0, pcie_replays=0)])
        self.fault_at_s = fault_at_s
        self.faulted = False

    def advance(self, elapsed_s: float) -> None:
        for i, gpu in enumerate(self.nvml.gpus):
            if i == 1 and self.faulted:
                continue
            wave = math.sin(elapsed_s / 7 + i)
            gpu.util_gpu = int(88 + 6 * wave)
            gpu.power_mw = int(1000 * (560 + 90 * wave - 30 * i))
            gpu.mem_used = int((52 + 4 * i + 2 * min(1.0, elapsed_s / 30)) * 2**30)
            gpu.temperature = int(min(87 - 5 * i, 60 + elapsed_s / 3))
            gpu.clock_reasons = self.THERMAL_SLOWDOWN if gpu.temperature >= 85 else self.POWER_CAP * (wave > 0.8)
            gpu.ecc_corrected = int(elapsed_s // 40) if i == 0 else 0
            gpu.pcie_replays = int(elapsed_s // 25) * (i + 1)
        if not self.faulted and elapsed_s >= self.fault_at_s:
            self.faulted = True
            lost = self.nvml.gpus[1]
            lost.util_gpu, lost.power_mw, lost.clock_reasons, lost.ecc_uncorrected = 0, 70_000, 0, 1
            self.nvml.push_xid(1, 79)


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _last_step(port: int) -> int | None:
    try:
        found = query(port, f'max(trainwarden_last_step{{job="{JOB}"}})')
    except (OSError, ValueError, AssertionError):
        return None
    return int(float(found[0]["value"][1])) if found else None


def run(args: argparse.Namespace) -> int:
    work = Path(args.workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    group = ProcessGroup()
    try:
        story = GpuStory(fault_at_s=args.gpu_fault_at)
        story.advance(0)
        with gpu_node_exporter("gpu-node", gpus=story.nvml, interval_s=0.5) as (exporter, _, _):
            metrics_port, prom_port = free_port(), free_port()
            gpu_target = exporter.url.split("//")[1].split("/")[0]
            start_prometheus(group, work / "prometheus", [f"127.0.0.1:{metrics_port}", gpu_target], port=prom_port)
            wait_for(lambda: _ready(prom_port), 60, interval=0.5, what="Prometheus to be ready")
            print(f"dashboard-pictures: Prometheus on http://127.0.0.1:{prom_port} scrapes the job's agent "
                  f"(:{metrics_port}) and a fake-NVML node ({gpu_target})", flush=True)

            env = gpt_env()
            env.update(TRAINWARDEN_STATE_HOME=str(work / "state"), TRAINWARDEN_FAULTS=args.faults)
            start = time.time()
            log = work / "run.log"
            job = group.spawn(
                [sys.executable, "-m", "trainwarden.agent.cli", "run", "--nproc-per-node", "8", "--max-restarts", "2",
                 "--metrics-port", str(metrics_port), "--job", JOB, "--",
                 "-m", "trainwarden.runtime.examples.gpt", "--dp", "2", "--tp", "2", "--pp", "2",
                 "--steps", str(args.steps), "--ckpt-every", "10"], log=log, env=env)
            print(f"dashboard-pictures: training {args.steps} steps with TRAINWARDEN_FAULTS='{args.faults}'; "
                  f"log {log}", flush=True)
            deadline, shown = time.monotonic() + args.timeout, None
            while job.poll() is None:
                if time.monotonic() > deadline:
                    print(f"dashboard-pictures: the job did not end in {args.timeout:.0f} s; log {log}",
                          file=sys.stderr)
                    return 1
                step = _last_step(prom_port)
                if step is not None and step > 0 and (shown is None or abs(step - shown) >= 20):
                    print(f"  step {step} ({time.time() - start:.0f} s)", flush=True)
                    shown = step
                story.advance(time.time() - start)
                time.sleep(1)
            if job.returncode != 0:
                print(f"dashboard-pictures: the job failed (exit {job.returncode}):\n"
                      + log.read_text(errors="replace")[-3000:], file=sys.stderr)
                return 1
            time.sleep(2)  # the recording rules see the last scrapes
            end = time.time()
            print(f"dashboard-pictures: the job ended after {end - start:.0f} s; drawing", flush=True)
            client = PrometheusClient(f"http://127.0.0.1:{prom_port}")
            layout = render.Layout(width_px=args.width, dpi=args.dpi)
            for board in BOARDS:
                path = render.render(board, client, Path(args.out) / render.output_name(board), start=start,
                                     end=end, step=args.step, variables={"job": JOB} if "job" in board.stem else {},
                                     layout=layout, scrape_interval_s=1, rate_interval="10s")
                print(f"dashboard-pictures: wrote {path} ({path.stat().st_size // 1024} KiB)", flush=True)
    finally:
        group.close()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "img"), help="where the PNGs go (default docs/img)")
    p.add_argument("--steps", type=int, default=160, help="steps the job trains (default %(default)s)")
    p.add_argument("--faults", default=FAULTS, help="TRAINWARDEN_FAULTS for the job (default %(default)s)")
    p.add_argument("--gpu-fault-at", type=float, default=75.0,
                   help="seconds into the run at which fake GPU 1 falls off the bus (default %(default)s)")
    p.add_argument("--step", type=float, default=1.0, help="seconds between points drawn (default %(default)s)")
    p.add_argument("--width", type=int, default=1600, help="picture width in pixels (default %(default)s)")
    p.add_argument("--dpi", type=int, default=100, help="dots per inch (default %(default)s)")
    p.add_argument("--timeout", type=float, default=900, help="give up on the job after this many seconds")
    p.add_argument("--workdir", default=str(ROOT / "runs" / "dashboard-pictures"),
                   help="logs, job state and Prometheus data (default runs/dashboard-pictures)")
    args = p.parse_args(argv)
    if not available():
        print("dashboard-pictures: prometheus is not installed (apt-get install prometheus)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind through run()'s finally: stop everything
    try:
        return run(args)
    except KeyboardInterrupt:
        print("dashboard-pictures: interrupted; everything it started is stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

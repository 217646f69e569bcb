"""Telemetry overhead on a GPU step of at least 50 ms (tests/bench/bench_telemetry.py --device cuda): rt.step with
CUDA event timing, the sender and NCCL Flight Recorder reads, against the same loop without trainwarden."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpu_figures

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_telemetry.py"


def test_telemetry_overhead_on_a_60_ms_gpu_step(tmp_path):
    out = tmp_path / "telemetry.json"
    run = subprocess.run([sys.executable, str(BENCH), "--device", "cuda", "--step-ms", "60", "--steps", "60",
                          "--rounds", "2", "--json", str(out)], capture_output=True, text=True, timeout=560,
                         start_new_session=True)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    figures = json.loads(out.read_text())
    gpu_figures.record("telemetry_overhead", **figures)
    assert figures["baseline_wall_s"] >= 0.05
    assert "nccl" in (figures["fr_recorders"] or [])  # the NCCL recorder is the one read
    assert figures["gpu_timed_steps"] > 0

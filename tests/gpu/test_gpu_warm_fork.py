"""Warm workers (runtime/zygote.py) with CUDA in the workers, on a real GPU: the zygote imports torch without
initialising CUDA, the worker it forks initialises CUDA, runs kernels and times a step with CUDA events."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import gpu_figures
from procs import wait_for

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCRIPT = """
import json, os, sys, time
import torch
from trainwarden.runtime.cuda_timing import CudaStepTimer, gpu_uuid
t0 = time.perf_counter()
x = torch.ones(1 << 20, device="cuda")  # CUDA is initialised here, in the forked worker
first_kernel_s = time.perf_counter() - t0
emitted = []
timer = CudaStepTimer(emitted.append)
token = timer.begin()
torch.cuda._sleep(20_000_000)
y = (x * 2).sum()
timer.end(token, ("step", 0, 0, 0, 0, None))
timer.close(timeout=30)
with open(sys.argv[1], "w") as f:
    json.dump({"pid": os.getpid(), "ppid": os.getppid(), "sum": float(y), "gpu_step_ns": emitted[0][3] if emitted else None,
               "first_kernel_s": first_kernel_s, "gpu_uuid": gpu_uuid()}, f)
"""


def test_a_forked_warm_worker_uses_cuda(procs, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    sock, map_dir = str(tmp_path / "z.sock"), str(tmp_path / "map")
    t0 = time.monotonic()
    zygote = procs.spawn([sys.executable, "-m", "trainwarden.runtime.zygote", "--serve", sock, map_dir, str(script)],
                         log=tmp_path / "zygote.log")
    wait_for(lambda: os.path.exists(sock) or zygote.poll() is not None, 120, what="the zygote to listen")
    assert zygote.poll() is None and not os.path.exists(sock + ".off"), (tmp_path / "zygote.log").read_text()
    zygote_ready_s = time.monotonic() - t0
    out = tmp_path / "result.json"
    env = {**os.environ, "TRAINWARDEN_WARM_SOCKET": sock}
    t0 = time.monotonic()
    client = subprocess.run([sys.executable, "-m", "trainwarden.runtime.zygote", str(script), str(out)], env=env,
                            capture_output=True, text=True, timeout=240, start_new_session=True)
    worker_s = time.monotonic() - t0
    assert client.returncode == 0, client.stderr[-3000:]
    result = json.loads(out.read_text())
    gpu_figures.record("warm_worker_fork_cuda", zygote_ready_s=zygote_ready_s, worker_run_s=worker_s, **result)
    assert result["ppid"] == zygote.pid  # forked by the zygote
    assert result["sum"] == 2.0 * (1 << 20)
    assert result["gpu_step_ns"] and result["gpu_step_ns"] > 0
    assert result["gpu_uuid"].startswith(("GPU-", "MIG-"))

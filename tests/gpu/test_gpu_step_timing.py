"""CUDA step timing (runtime/cuda_timing.py) against a kernel of known length, on a real GPU."""

import statistics
import time

import pytest
import torch

import gpu_figures
from trainwarden.runtime.cuda_timing import CudaStepTimer, gpu_uuid

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _cycles_for(ms: float) -> int:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(10_000_000)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return round(10_000_000 * ms / start.elapsed_time(end))


def test_gpu_step_times_match_the_kernels_length_and_the_cpu_never_waits():
    torch.cuda.init()
    cycles = _cycles_for(100.0)
    emitted = []
    timer = CudaStepTimer(emitted.append)
    steps = 10
    enqueue_s, reference_s = [], []
    try:
        torch.cuda.synchronize()
        for i in range(steps):
            # reference: the kernel alone, timed by the wall clock around synchronizes (test code only)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.cuda._sleep(cycles)
            torch.cuda.synchronize()
            reference_s.append(time.perf_counter() - t0)
            # the timed step: nothing waits for the GPU on this thread
            t0 = time.perf_counter()
            token = timer.begin()
            torch.cuda._sleep(cycles)
            timer.end(token, ("step", i, 0, int((time.perf_counter() - t0) * 1e9), 0, None))
            enqueue_s.append(time.perf_counter() - t0)
        deadline = time.monotonic() + 60
        while len(emitted) < steps and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        timer.close(timeout=10)
    gpu_s = [r[3] / 1e9 for r in emitted]
    ratio = statistics.median(gpu_s) / statistics.median(reference_s)
    gpu_figures.record("cuda_step_timing", steps=steps, gpu_step_ms=[round(s * 1e3, 3) for s in gpu_s],
                       reference_ms=[round(s * 1e3, 3) for s in reference_s],
                       cpu_enqueue_ms=[round(s * 1e3, 3) for s in enqueue_s], median_ratio=ratio,
                       resolved=timer.resolved, cpu_timed=timer.cpu_timed, gpu_uuid=gpu_uuid())
    assert [r[1] for r in emitted] == list(range(steps)) and timer.cpu_timed == 0
    assert abs(ratio - 1) <= 0.05, (gpu_s, reference_s)
    # what the CPU clock would have said: the enqueue, a small fraction of the step
    assert statistics.median(enqueue_s) < 0.5 * statistics.median(reference_s)
    uuid = gpu_uuid()
    assert uuid.startswith(("GPU-", "MIG-")) and len(uuid) > 30

"""NCCL's Flight Recorder read by trainwarden's reader, on a real GPU: one rank, timing on (`make gpu-check`)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import gpu_figures

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RUN = textwrap.dedent("""
    import json, tempfile, time
    import torch, torch.distributed as dist
    from trainwarden.runtime.flight_recorder import ArrivalLog, CollectiveReducer, FlightRecorder, torch_recorders
    import threading
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    fr = FlightRecorder()
    x = torch.ones(1 << 20, device="cuda")
    for _ in range(5):
        torch.cuda._sleep(5_000_000)  # NCCL's stream waits for it before the start event: duration_ms is the collective's alone
        dist.all_reduce(x)
    torch.cuda.synchronize()
    got, deadline = [], time.monotonic() + 30
    while len(got) < 5 and time.monotonic() < deadline:  # the watchdog retires completed work
        got += fr.read_new()
        time.sleep(0.2)
    reducer = CollectiveReducer()
    reducer.add_entries(got)
    batch = ArrivalLog(threading.get_ident(), members=lambda n: None).add(got, complete_below=fr.complete_below,
                                                                          missed=fr.missed)
    print(json.dumps({"recorders": sorted(torch_recorders()), "entries": got, "has_durations": reducer.has_durations,
                      "arrivals": len(batch.arrivals),
                      "waits": [[s.op, s.count, s.wait_seconds] for s in reducer.summaries()]}))
    dist.destroy_process_group()
""")


def test_nccls_recorder_is_read_with_states_and_durations():
    env = dict(os.environ, TORCH_FR_BUFFER_SIZE="64", TORCH_NCCL_ENABLE_TIMING="1")
    out = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True, timeout=240,
                         start_new_session=True)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    entries = [e for e in result["entries"] if e["recorder"] == "nccl"]
    gpu_figures.record("nccl_recorder", recorders=result["recorders"], entries=len(entries),
                       states=sorted({e["state"] for e in entries}),
                       durations_ms=[e.get("duration_ms") for e in entries], arrivals=result["arrivals"],
                       waits=result["waits"],
                       discovered_span_ms=[(e["time_discovered_completed_ns"] - e["time_discovered_started_ns"]) / 1e6
                                           for e in entries if e.get("time_discovered_started_ns")])
    assert "nccl" in result["recorders"]
    assert len(entries) == 5 and all(e["profiling_name"] == "nccl:all_reduce" for e in entries)
    assert all(e["state"] == "completed" and e.get("duration_ms") is not None for e in entries)
    assert result["has_durations"] and result["arrivals"] == 5

"""Checkpoint stall of a >= 400M-parameter model with AdamW state on a real GPU: the training step's wait in
`Checkpointer.save` against the raw device-to-host copy of the same tensors into pinned memory and against DCP's
own ``async_save`` (the time until it returns). Figures only, plus the sanity of each number."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import gpu_figures

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RUN = textwrap.dedent("""
    import json, statistics, sys, tempfile, time
    from pathlib import Path
    import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from trainwarden.runtime.checkpoint import Checkpointer, ModelState

    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    layers, width = 24, 4096  # 24 x 4096^2 = 403M parameters, fp32
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).cuda()
    params = sum(p.numel() for p in model.parameters())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, width, device="cuda")).sum().backward()
    optim.step()
    torch.cuda.synchronize()
    tensors = [t for t in list(model.state_dict().values()) + [v for s in optim.state.values() for v in s.values()]
               if torch.is_tensor(t) and t.is_cuda]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    raw = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for dst, src in zip(pinned, tensors):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        raw.append(time.perf_counter() - t0)
    root = Path(sys.argv[1])
    state = {"train": ModelState(model, optim)}
    ckpt = Checkpointer(root / "trainwarden", keep=1)
    state_dict_s = []
    for _ in range(3):  # get_state_dict alone: part of every save's stall
        t0 = time.perf_counter()
        state["train"].state_dict()
        state_dict_s.append(time.perf_counter() - t0)
    stalls, errors = [], []
    for step in range(5):  # the first save allocates the staging buffers (cold)
        failed = ckpt.failed_saves
        t0 = time.perf_counter()
        ckpt.save(step, state)
        stalls.append(time.perf_counter() - t0)
        if ckpt.failed_saves != failed:
            errors.append(repr(ckpt.last_error))
        ckpt.wait()
    committed = ckpt.last_committed.step if ckpt.last_committed else None
    ckpt.close()
    dcp_async = []
    for step in range(3):
        t0 = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(root / "dcp" / f"step-{step}"))
        dcp_async.append(time.perf_counter() - t0)
        future.result()
    print(json.dumps({"parameters": params, "state_bytes": nbytes, "raw_d2h_s": raw, "trainwarden_stall_s": stalls,
                      "save_errors": errors, "last_committed_step": committed, "state_dict_s": state_dict_s,
                      "dcp_async_save_return_s": dcp_async,
                      "raw_d2h_gbps": nbytes / statistics.median(raw) / 1e9}))
    dist.destroy_process_group()
""")


def test_checkpoint_stall_of_a_400m_parameter_model_against_the_raw_copy_and_dcp_async_save(tmp_path):
    out = subprocess.run([sys.executable, "-c", RUN, str(tmp_path)], env=dict(os.environ), capture_output=True,
                         text=True, timeout=540, start_new_session=True)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    warm_stall = min(result["trainwarden_stall_s"][1:])
    result.update(warm_stall_s=warm_stall, stall_over_raw_copy=warm_stall / min(result["raw_d2h_s"]),
                  stall_over_dcp_async=warm_stall / min(result["dcp_async_save_return_s"][1:]))
    gpu_figures.record("checkpoint_stall", **result)
    assert result["save_errors"] == [] and result["last_committed_step"] == 4, (result, out.stderr[-3000:])
    assert result["parameters"] >= 400_000_000
    assert result["stall_over_raw_copy"] <= 2.0  # the goal (issue 29); 1.06 on an H100, 2026-11-26
    assert all(s > 0 for s in result["raw_d2h_s"] + result["trainwarden_stall_s"] + result["dcp_async_save_return_s"])

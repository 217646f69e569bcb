"""A hang on a GPU, under `trainwarden run` (issue 26): the waiting rank's training thread spins a core inside a
CUDA synchronize while its NCCL all-reduce is in flight. The watchdog counts a rank's CPU as work (a rank that
computes between steps is not hung), so before the training thread said it was still inside one call with a
collective in flight, this spin held every NCCL hang to the 300 s busy deadline. Now it is caught on the usual
deadline.

One GPU holds one NCCL rank, so the peer that never arrives is played by a kernel that runs for minutes: NCCL's
all-reduce waits behind it on the GPU as it would wait for a missing peer, and `.item()` waits for both.
"""

import os
import re
import subprocess
import sys
import time

import pytest
import torch

import gpu_figures
from trainwarden.agent.incidents import IncidentKind
from trainwarden.agent.incidents.store import list_incidents

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCRIPT = """
import os, sys, threading, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
dist.init_process_group("nccl")
model = DDP(torch.nn.Linear(1024, 1024).cuda())
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(64, 1024, device="cuda")
for step in range(int(sys.argv[1])):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"[{step:04d}] loss={loss.item():.5f}", flush=True)
    time.sleep(0.05)

def sample():  # the process's CPU while its training thread waits (this thread runs: the wait released the GIL)
    last = (time.monotonic(), time.process_time())
    while True:
        time.sleep(1.0)
        now = (time.monotonic(), time.process_time())
        print(f"cpu share {(now[1] - last[1]) / (now[0] - last[0]):.2f}", flush=True)
        last = now

threading.Thread(target=sample, daemon=True).start()
torch.cuda._sleep(10 ** 12)  # minutes of one kernel: the peer that never arrives
t = torch.ones(1, device="cuda")
dist.all_reduce(t)  # in flight behind it
print("hang", time.time(), flush=True)
print("never", t.item())  # the training thread waits here, inside a CUDA synchronize
"""


def test_a_gpu_rank_spinning_in_a_cuda_synchronize_behind_its_collective_is_hung_on_the_usual_deadline(procs, tmp_path):
    script = tmp_path / "gpu_hang.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINWARDEN_")}
    env.update(PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    cmd = [sys.executable, "-m", "trainwarden.agent.cli", "run", "--nproc-per-node", "1", "--max-restarts", "0",
           "--metrics-port", "0", "--job", "gpuhang", "--state-home", str(tmp_path / "state"), "--",
           str(script), "30"]
    t0 = time.monotonic()
    proc = procs.spawn(cmd, log=tmp_path / "run.log", env=env)
    try:
        rc = proc.wait(200)  # the busy deadline is 300 s: still running at 200 s, the spin was taken for work
    except subprocess.TimeoutExpired:
        procs.kill(proc)
        pytest.fail(f"no hang caught in 200 s:\n{(tmp_path / 'run.log').read_text()[-4000:]}")
    run_s = time.monotonic() - t0
    text = (tmp_path / "run.log").read_text(errors="replace")
    shares = [float(s) for s in re.findall(r"cpu share ([0-9.]+)", text)]
    hangs = [i for i in list_incidents(tmp_path / "state", "gpuhang") if i.kind is IncidentKind.HANG]
    gpu_figures.record("hang_spin", run_s=run_s, rc=rc, cpu_shares_while_waiting=shares,
                       evidence={k: v for k, v in (hangs[0].evidence if hangs else {}).items()
                                 if k in ("stalled_seconds", "timeout_seconds", "deadline", "summary")})
    assert rc != 0 and "hang" in text, text[-4000:]
    assert len(hangs) == 1, text[-4000:]
    assert hangs[0].evidence["deadline"] == "steady", hangs[0].evidence
    assert hangs[0].evidence["timeout_seconds"] < 30, hangs[0].evidence

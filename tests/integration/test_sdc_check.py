"""Silent data corruption (issue 48, item 4), on real torchrun workers with gloo on CPU.

The reference job under `trainwarden run` (agent, embedded etcd), two data-parallel replicas, the check every 2
steps, and `gradflip:rank=1,step=4`: at step 4 rank 1 computes the probe micro-batch's gradient with one mantissa bit
inverted (finite: the numeric guard cannot see it). The replicas disagree, rank 1's recompute agrees with rank 0's,
and rank 1 is named: one `numeric` incident of kind `sdc` on its node, and no other incident; the checks of the
other steps agree and the job trains to the end. In a pipeline (dp 2 x pp 2) each stage's replicas check their stage on
their own: rank 1 (stage 0, whose check has no loss of its own) is named, and the last stage's replicas (ranks 2
and 3, whose check takes drawn hidden states) agree. With tensor parallelism inside the pipeline too (dp 2 x tp 2 x
pp 2), each rank's plain replica gathers its stage's full weights over its tensor-parallel group.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import textwrap

import pytest

from gpt_helpers import gpt_env, run_user_loop

pytestmark = pytest.mark.integration


@pytest.mark.e2e
@pytest.mark.timeout(360)
@pytest.mark.parametrize("mesh, reporter_sees", [
    (["--dp", "2"], "rank(s) 1 differ"),  # rank 0 reports, in rank 1's group
    (["--dp", "2", "--pp", "2"], "the replicas agree"),  # rank 2 reports: the last stage's group, ranks 2 and 3
    # tensor parallelism inside the pipeline: each rank's replica gathers its stage's full weights (a collective over
    # its tensor-parallel group); rank 1 is stage 0's second tensor-parallel rank
    (["--dp", "2", "--tp", "2", "--pp", "2"], "the replicas agree"),
], ids=["dp2", "dp2-pp2", "dp2-tp2-pp2"])
def test_a_flipped_gradient_bit_is_named_to_its_rank_and_node(procs, tmp_path, mesh, reporter_sees):
    env = gpt_env()
    env.update(TRAINWARDEN_STATE_HOME=str(tmp_path / "state"), TRAINWARDEN_FAULTS="gradflip:rank=1,step=4")
    log = tmp_path / "run.log"
    ranks = 2 * (2 if "--pp" in mesh else 1) * (2 if "--tp" in mesh else 1)
    proc = procs.spawn(
        [sys.executable, "-m", "trainwarden.agent.cli", "run", "--metrics-port", "0", "--nproc-per-node",
         str(ranks), "--max-restarts", "0", "--job", "sdc", "--",
         "-m", "trainwarden.runtime.examples.gpt", *mesh, "--steps", "6", "--sdc-every", "2", "--ckpt-every", "100"],
        log=log, env=env)
    rc = proc.wait(300)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-4000:]
    assert re.search(r"done steps=6 final_loss=\d", text), text[-2000:]
    found = re.findall(r"silent-corruption check at step (\d+): (.+?) \(([\d.]+) ms on this rank\)", text)
    checks = {step: verdict for step, verdict, _ in found}
    assert checks == {"2": "the replicas agree", "4": reporter_sees, "6": "the replicas agree"}, text[-4000:]
    incidents = [json.loads(p.read_text())
                 for p in sorted((tmp_path / "state" / "jobs" / "sdc" / "incidents").glob("*.json"))]
    assert [(i["kind"], i["evidence"]["kind"], i["ranks"], i["evidence"]["step"], i["node"]) for i in incidents] == [
        ("numeric", "sdc", [1], 4, socket.gethostname())], incidents
    assert "recompute differed" in incidents[0]["evidence"]["detail"]
    assert "drain it if it is named again" in incidents[0]["outcome"], incidents[0]
    print(f"silent-corruption check, ms per check on rank 0: {[float(ms) for *_, ms in found]}")  # -s: its cost


USER_LOOP = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from trainwarden.runtime.sdc_check import SdcCheck

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    check = SdcCheck(None, every=2)  # a session from trainwarden.runtime.init() makes a named rank an incident
    for step in range(1, 9):
        torch.manual_seed(step * 100 + rank)
        opt.zero_grad()
        model(torch.randn(5, 16)).square().mean().backward()
        opt.step()
        if check.due(step):
            probe = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))  # the same on every replica

            def compute():
                grads = torch.autograd.grad(model.module(probe).square().mean(), list(model.module.parameters()))
                if rank == 1 and step == 4:
                    grads[0].view(-1)[3] += 1e-3  # what a bad core does: finite, and wrong
                return grads

            check.check(step, compute)
    events = [(e.step, e.ranks, e.resolved) for e in check.events]
    sys.stdout.write(f"rank {rank} checks={check.checks} events={events}\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    os._exit(0)  # torch 2.13's gloo can abort at exit after a collective (tests/integration/test_numeric.py)
""")


@pytest.mark.timeout(180)
def test_a_users_own_loop_names_the_replica_that_computes_wrong(procs, tmp_path):
    """The check in a user's own DDP loop (three replicas under plain torchrun): rank 1's probe gradient is off at step
    4, the two others agree, and every rank decides the same: rank 1, without a recompute."""
    text = run_user_loop(procs, tmp_path, USER_LOOP, nproc=3)
    lines = sorted(re.findall(r"rank (\d) checks=(\d+) events=(\[.*?\])\n", text))
    assert lines == [(r, "4", "[(4, (1,), True)]") for r in "012"], text[-3000:]

"""The reference 3-D parallel GPT under real torchrun with gloo on CPU (pp2 x tp2 x dp2 = 8 ranks).

One uninterrupted run and one run resuming from its checkpoint of step 8 are shared by the module's tests (each
costs ~20-40 s of torchrun start-up and training on two cores)."""

from __future__ import annotations

import math
import re

import pytest

from gpt_helpers import final_line, run_gpt
from procs import ProcessGroup

pytestmark = pytest.mark.integration

MESH_8 = ["--dp", "2", "--tp", "2", "--pp", "2"]
STRAIGHT_STEPS = 13


@pytest.fixture(scope="module")
def module_procs():
    group = ProcessGroup()
    try:
        yield group
    finally:
        group.close()


@pytest.fixture(scope="module")
def straight_ckpt(tmp_path_factory):
    return tmp_path_factory.mktemp("straight") / "ckpt"


@pytest.fixture(scope="module")
def straight(module_procs, straight_ckpt):
    """13 uninterrupted steps with one checkpoint, of step 8 (no save at the end): where ``resumed`` starts. That
    saving leaves the losses alone is still checked: the crash test's run saves at step 4 (and snapshots every
    step) and its steps 5-8 must equal these, and the resumed run saves at step 12 and its steps must too."""
    return run_gpt(module_procs, straight_ckpt.parent / "torchrun.log", nproc=8,
                   args=[*MESH_8, "--steps", str(STRAIGHT_STEPS), "--ckpt-dir", str(straight_ckpt), "--ckpt-every", "8"])


@pytest.fixture(scope="module")
def resumed(straight, straight_ckpt, module_procs):
    """A second run on the straight run's checkpoints: it resumes from step 8 and trains to step 12, saving every 4
    (step 12's checkpoint is where test_dp2_checkpoint_restores_into_dp1 starts). Returns (run, dir)."""
    assert straight.returncode == 0, straight.describe()
    assert sorted(p.name for p in straight_ckpt.glob("step-*")) == ["step-00000008"]
    second = run_gpt(module_procs, straight_ckpt.parent / "resumed.log", nproc=8,
                     args=[*MESH_8, "--ckpt-dir", str(straight_ckpt), "--ckpt-every", "4", "--steps", "12"])
    return second, straight_ckpt


@pytest.mark.timeout(300)
def test_eight_rank_run_completes_with_decreasing_loss(straight):
    assert straight.returncode == 0, straight.describe()
    assert sorted(straight.losses) == list(range(1, STRAIGHT_STEPS + 1)), straight.describe()
    losses = [float(straight.losses[s]) for s in sorted(straight.losses)]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5, losses
    assert final_line(straight.log) == (STRAIGHT_STEPS, straight.losses[STRAIGHT_STEPS])


@pytest.mark.timeout(400)
def test_resume_reproduces_uninterrupted_losses_exactly(straight, resumed):
    second, ckpt = resumed
    assert second.returncode == 0, second.describe()
    assert "resumed from checkpoint step 8" in second.log, second.describe()
    assert sorted(second.losses) == [9, 10, 11, 12], second.describe()   # no step re-run or skipped
    for step in range(9, 13):
        got = second.losses[step]
        assert got == straight.losses[step], f"step {step}: resumed {got} != uninterrupted {straight.losses[step]}"
    assert (ckpt / "step-00000012").is_dir()


@pytest.mark.timeout(300)
def test_dp2_checkpoint_restores_into_dp1(straight, resumed, module_procs, tmp_path):
    second, ckpt = resumed
    assert second.returncode == 0, second.describe()
    run = run_gpt(module_procs, tmp_path / "dp1.log", nproc=4,
                  args=["--dp", "1", "--tp", "2", "--pp", "2", "--ckpt-dir", str(ckpt), "--ckpt-every", "4",
                        "--steps", "13"])
    assert run.returncode == 0, run.describe()
    assert "resumed from checkpoint step 12" in run.log, run.describe()
    assert sorted(run.losses) == [13], run.describe()
    # same global batch, resharded weights and optimizer: equal up to reduction order
    assert float(run.losses[13]) == pytest.approx(float(straight.losses[13]), rel=1e-3)


# A mesh that does not match the world: tests/unit/test_model.py runs the worker's main() as rank 3 of 4 (no torchrun).


def _run_faulted(procs, tmp_path, job: str, faults: str, flags: list[str]) -> str:
    """The reference job (8 ranks, a checkpoint every 4 steps) under `trainwarden run` with ``faults`` injected and
    ``flags`` for the launcher; asserts it succeeded and returns its output."""
    import sys

    from gpt_helpers import gpt_env

    env = gpt_env()
    env.update(TRAINWARDEN_STATE_HOME=str(tmp_path / "state"), TRAINWARDEN_FAULTS=faults)
    log = tmp_path / "run.log"
    proc = procs.spawn(
        [sys.executable, "-m", "trainwarden.agent.cli", "run", "--metrics-port", "0", "--nproc-per-node", "8",
         "--max-restarts", "1", "--job", job, *flags, "--",
         "-m", "trainwarden.runtime.examples.gpt", *MESH_8, "--steps", str(STRAIGHT_STEPS), "--ckpt-every", "4"],
        log=log, env=env,
    )
    rc = proc.wait(360)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-4000:]
    return text


@pytest.mark.e2e
@pytest.mark.timeout(400)
@pytest.mark.parametrize("start", [pytest.param("cold", marks=pytest.mark.extended), "warm"])
def test_crash_under_trainwarden_run_resumes_to_the_same_losses(straight, module_procs, tmp_path, start):
    """`crash` at step 10 under `trainwarden run`: torchrun restarts the group through the etcd3
    rendezvous, every rank restores, and every printed loss equals the uninterrupted run's. ``warm`` (the
    defaults): the restarted ranks are forked from the zygote (runtime/zygote.py) and restore the step before
    the crash from the agent's memory snapshots (issue 26). ``cold``: --cold-workers --no-memory-snapshots, new
    interpreters as torchrun starts them, restoring step 8 from disk."""
    import os

    from gpt_helpers import parse_losses

    text = _run_faulted(module_procs, tmp_path, "crash", "crash:rank=5,step=10", [
        "--monitor-interval", "0.5", *(["--cold-workers", "--no-memory-snapshots"] if start == "cold" else []),
        "--model-params", "1e6", "--peak-tflops", "0.001"])
    assert straight.returncode == 0, straight.describe()
    losses = parse_losses(text)  # asserts that steps 9 and 10, printed twice, agree
    assert losses == straight.losses
    assert final_line(text) == final_line(straight.log)
    if start == "warm":  # rank 5's snapshot of step 9 may not be written when it crashes: then every rank has 8
        assert re.search(r"resumed from the memory snapshot of step [89] ", text), text[-3000:]
    else:  # step 8's asynchronous save may still be in flight when the crash hits: then step 4 is the newest
        # complete checkpoint, and resuming from it must reproduce the same losses
        assert re.search(r"resumed from checkpoint step [48] ", text)
        assert "memory snapshot" not in text.replace("memory snapshots: off", "")
    if start == "warm":  # the first round's ranks and the restarted ones were forked from the zygote, none cold
        forked = sorted(int(r) for r in re.findall(r"warm worker pid \d+ forked for rank (\d+)", text))
        assert forked == sorted(list(range(8)) * 2), forked
    else:
        assert "warm worker pid" not in text
    # the summary's "failed after" is the newest step the agent heard of: a rank's report of step 9 is batched
    # (flushed every 0.5 s) and is lost when rank 5's crash takes the group down before the flush, so 8 or 9
    assert re.search(r"restarts     1 \(failed after step [89], resumed at step ([59]|10), [0-9.]+s lost\)", text), text[-800:]
    ckpts = tmp_path / "state" / "jobs" / "crash" / "checkpoints"
    assert os.path.exists(ckpts / "latest")
    # goodput (issue 27): the launch to the first step and the restart are badput, and the steps it kept match the
    # workers' own measure (the printing rank's step times, the last run of each step) within the ranks' skew
    goodput = re.search(r"goodput      ([\d.]+)% of ([\d.]+)s \(([^)]*)\)", text)
    assert goodput, text[-1500:]
    causes = {name: float(seconds.rstrip("s")) for name, seconds in
              (part.rsplit(" ", 1) for part in goodput.group(3).split(", "))}
    assert causes.get("startup", 0) > 0 and causes.get("restart", 0) > 0, causes
    kept = {int(m.group(1)): float(m.group(2)) for m in
            re.finditer(r"\[rank \d+\] [\w.]+: step (\d+) loss \S+ time ([\d.]+)s", text)}
    productive = float(goodput.group(1)) / 100 * float(goodput.group(2))
    assert abs(sum(kept.values()) - productive) <= 0.15 * productive + 0.5, (sum(kept.values()), productive)
    # MFU: 6 x 1e6 FLOPs per token at the job's tokens/s, over 8 accelerators of 1 GFLOPS; the workers' own
    # tokens/s (rank 0 prints the job's, from the step time alone) bounds it from above
    mfu = re.search(r"mfu          ([\d.]+)% \(6 x --model-params x tokens, 0.001 TFLOPS per accelerator", text)
    assert mfu, text[-1500:]
    printed = sorted(float(t) for t in re.findall(r": step \d+ loss \S+ time \S+ tok/s (\d+)", text))
    expected = 100 * 6e6 * printed[len(printed) // 2] / (1e9 * 8)
    assert 0.3 * expected < float(mfu.group(1)) < 1.2 * expected, (mfu.group(1), expected)
    # torchrun reports the failed workers it noticed (peers rank 5 took down exit 1); the incident names the
    # one killed by a signal, whose stream broke without a goodbye, and calls the others collateral
    import json
    found = [json.loads(p.read_text()) for p in (tmp_path / "state" / "jobs" / "crash" / "incidents").glob("*.json")]
    crashes = [i for i in found if i["kind"] == "crash"]
    assert [c["ranks"] for c in crashes] == [[5]], crashes
    assert {"rank": 5, "goodbye": None} in [{"rank": e["rank"], "goodbye": e["goodbye"]}
                                            for e in crashes[0]["evidence"]["telemetry_streams_ended"]]
    # when the crash interrupted step 8's save, restore sets the unfinished copy aside: a second incident
    assert re.search(r"incidents    (checkpoint_set_aside 1 \(rank 0\), )?crash 1 \(rank 5; \d collateral\) ", text), text[-800:]


@pytest.mark.e2e
@pytest.mark.extended  # ~60 s; a hang's recovery from memory stays in test_watchdog_e2e.py (hang-2-warm)
@pytest.mark.timeout(400)
def test_a_hang_under_trainwarden_run_resumes_from_memory_to_the_same_losses(straight, module_procs, tmp_path):
    """Rank 2 blocks forever at step 10 (issue 26): the watchdog aborts the job, the restarted ranks restore the step
    before the hang from the agent's memory snapshots (the disk holds only step 4's and maybe step 8's checkpoint),
    and every printed loss equals the uninterrupted run's."""
    import json

    from gpt_helpers import parse_losses

    text = _run_faulted(module_procs, tmp_path, "hangmem", "hang:rank=2,step=10", [])
    assert straight.returncode == 0, straight.describe()
    assert parse_losses(text) == straight.losses  # steps printed twice agree, and all match
    assert final_line(text) == final_line(straight.log)
    # rank 2 stopped before step 10: every rank's snapshot of step 9 was written by then (or of 8 at worst)
    assert re.search(r"resumed from the memory snapshot of step [89] ", text), text[-3000:]
    found = [json.loads(p.read_text()) for p in (tmp_path / "state" / "jobs" / "hangmem" / "incidents").glob("*.json")]
    hangs = [i for i in found if i["kind"] == "hang"]
    assert [h["ranks"] for h in hangs] == [[2]], found
    # step 8's background write ended on every rank before the deadline ran out (the write's thread is not the
    # hung one), and each said so: the agent keeps the steps it slowed out of the steady step time
    stages = hangs[0]["evidence"]["checkpoint_stages"]
    assert stages == {"0": "committed", **{str(r): "written" for r in range(1, 8)}}, stages


@pytest.mark.timeout(300)
def test_gradient_accumulation_keeps_the_global_batch_when_data_parallelism_shrinks(module_procs, tmp_path):
    """``--micro-batch-size 2`` with a global batch of 8: two ranks of dp take two micro-batches each, one rank
    takes four and accumulates their gradients. Same samples, same update: the losses agree at every step
    (up to reduction order), as after a node loss that halves dp."""
    common = ["--tp", "1", "--pp", "1", "--batch", "8", "--micro-batch-size", "2", "--steps", "6"]
    dp2 = run_gpt(module_procs, tmp_path / "dp2.log", nproc=2, args=common)
    dp1 = run_gpt(module_procs, tmp_path / "dp1.log", nproc=1, args=common)
    # no accumulation: the reference for the accumulating branch, whose mistakes dp1 and dp2 would share
    plain = run_gpt(module_procs, tmp_path / "plain.log", nproc=1, args=["--tp", "1", "--batch", "8", "--steps", "6"])
    for run in (dp2, dp1, plain):
        assert run.returncode == 0 and sorted(run.losses) == list(range(1, 7)), run.describe()
    for step in range(1, 7):
        assert float(dp1.losses[step]) == pytest.approx(float(dp2.losses[step]), rel=1e-4), step
        assert float(dp1.losses[step]) == pytest.approx(float(plain.losses[step]), rel=1e-4), step
    # a size that does not divide a rank's share is refused by parse_args: tests/unit/test_model.py


@pytest.mark.extended  # ~30-36 s; every reference-job run in the default suite builds its stages with their shapes
@pytest.mark.timeout(300)
def test_pipeline_stages_built_with_their_shapes_train_as_inferred_ones(module_procs, tmp_path):
    """Four stages (a first, two middle and a last): built with the micro-batch's shapes (the default) and left
    to infer them on the first step (torch's default), the losses are the same at every step."""
    common = ["--dp", "1", "--tp", "1", "--pp", "4", "--micro-batches", "4", "--steps", "5"]
    given = run_gpt(module_procs, tmp_path / "given.log", nproc=4, args=common)
    inferred = run_gpt(module_procs, tmp_path / "inferred.log", nproc=4, args=[*common, "--infer-pipeline-shapes"])
    for run in (given, inferred):
        assert run.returncode == 0 and sorted(run.losses) == list(range(1, 6)), run.describe()
    assert "stages built with their shapes (2 sequences a micro-batch)" in given.log, given.describe()
    assert "stages infer their shapes on the first step" in inferred.log, inferred.describe()
    assert given.losses == inferred.losses

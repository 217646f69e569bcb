"""A real worker client and a real agent server: steps that keep ending go in fewer batches once the agent asks
(runtime/send_pace.py), each promising the next, and the agent hears at once when they stop."""

import json
import re
import sys
import textwrap
import time

import pytest

from gpt_helpers import gpt_env
from procs import wait_for
from test_telemetry import rank_state
from trainwarden.agent.shared import telemetry_pb2 as pb
from trainwarden.runtime.session import init

pytestmark = pytest.mark.integration


def _rank(js, job):
    return rank_state(js, job, 0)


def _counted(messages, batches):
    batches.append(sum(m.WhichOneof("record") == "steps" for m in messages))
    return messages


def _train(rt, first, seconds, step_s=0.02):
    """Steps of `step_s` for `seconds`; the index after the last."""
    index, end = first, time.monotonic() + seconds
    while time.monotonic() < end:
        with rt.step(index):
            time.sleep(step_s)
        index += 1
    return index


@pytest.mark.timeout(120)
def test_steps_that_keep_ending_go_in_fewer_batches_each_promising_the_next_and_their_stop_is_said(server):
    srv, js = server
    rt = init("paced-send", env={"RANK": "0", "WORLD_SIZE": "1"}, socket_path=str(srv.socket_path))
    client = rt._client
    batches = []  # the Steps messages the sender built, each drain's count (Flight Recorder totals left out)
    drain = client._drain
    client._drain = lambda *a, **k: _counted(drain(*a, **k), batches)
    try:
        index = _train(rt, 0, 0.2)
        wait_for(lambda: (_rank(js, "paced-send") or None) and _rank(js, "paced-send").connected, 10,
                 what="the stream")
        # at the worker's own pace: a batch every flush, promising nothing
        sent0 = len(batches)
        index = _train(rt, index, 5.0)
        own = sum(batches[sent0:])
        assert client.held == 0 and not _rank(js, "paced-send").steps_promised
        # the agent asks for a send every 2 s while steps keep ending
        assert srv.send_command("paced-send", 0, pb.AgentCommand(read_pace=pb.ReadPace(
            max_period_seconds=6.0, step_send_seconds=2.0)))
        wait_for(lambda: client._send_pace.asked_s == 2.0, 10, what="the send pace to apply")
        index = _train(rt, index, 0.6)  # its first batch goes at once and promises the next
        sent0 = len(batches)
        index = _train(rt, index, 5.0)
        held = sum(batches[sent0:])
        assert client.held > 0 and _rank(js, "paced-send").steps_promised
        # fewer batches over the same time (about 10 at the flush pace, 3 held; half is the margin for a loaded
        # machine: counting every message, Flight Recorder totals too, came within one of it)
        assert held * 2 <= own, (held, own)
        print(f"step batches in 5 s: {own} at the flush pace, {held} with steps held up to 2 s")
        # the steps stop: the next look says so, with what it held, so the agent knows every step
        wait_for(lambda: _rank(js, "paced-send").steps_stopped, 10, what="the stop to be said")
        rank = _rank(js, "paced-send")
        assert rank.step_count == index and rank.last_step == index - 1 and not rank.steps_promised
        # they start again: the first batch goes at once, promising again
        index = _train(rt, index, 0.1)
        wait_for(lambda: _rank(js, "paced-send").steps_promised, 10, what="a new promise")
        # the agent asks for its own pace again: the next batch promises nothing
        assert srv.send_command("paced-send", 0, pb.AgentCommand(read_pace=pb.ReadPace()))
        wait_for(lambda: client._send_pace.asked_s == 0.0, 10, what="the worker's own pace")
        index = _train(rt, index, 1.2)
        wait_for(lambda: not _rank(js, "paced-send").steps_promised and _rank(js, "paced-send").steps_stopped, 10,
                 what="the promise withdrawn")
    finally:
        rt.close()
    rank = _rank(js, "paced-send")
    assert rank.step_count == index  # nothing held back was lost at the end


HANG_AFTER_HOLDING = textwrap.dedent("""
    import atexit, os, sys, time, torch, torch.distributed as dist
    import trainwarden.runtime
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rt = trainwarden.runtime.init()
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    x, holding, step = torch.ones(1000), 0, 0
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        # every rank's sender has held steps back (the agent asked once the job was quiet): ten steps more, then
        # rank 1 stops before its all-reduce and the others wait for it there
        flag = torch.tensor([float(rt.stats["held"] > 0)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        holding = holding + 1 if flag.item() else 0
        # (after the restart the job may be asked to hold at once: the agent's quiet outlives a worker round, so
        # only the step count ends the second round; CI once saw it holding by its step 89)
        if (holding == 10 and not restarted) or (restarted and step == 100):
            break
        with rt.step(step):
            time.sleep(0.02)
            dist.all_reduce(x)
        step += 1
    print(f"rank {rank} round {int(restarted)} at step {step}: held={rt.stats['held']}", flush=True)
    if holding == 10 and not restarted:
        if rank == 1:
            time.sleep(3600)
        with rt.step(step):
            dist.all_reduce(x)
    rt.close()
    dist.destroy_process_group()
    atexit._run_exitfuncs()  # torch 2.13's gloo can abort a finished rank in finalization (test_numeric.py)
    sys.stdout.flush()
    os._exit(0)
""")


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_rank_that_stops_while_the_ranks_hold_their_steps_is_named_a_hang_and_the_job_resumes(procs, tmp_path):
    """Under `trainwarden run`: the job goes quiet, the agent asks its ranks to hold their steps, they do; then
    rank 1 stops. The others say at their next look that their steps stopped, and the hang is named and
    recovered as when every batch went at once."""
    script = tmp_path / "held.py"
    script.write_text(HANG_AFTER_HOLDING)
    env = gpt_env()
    env.update(TRAINWARDEN_STATE_HOME=str(tmp_path / "state"), TRAINWARDEN_QUIET_STEP_SEND_S="2")  # the default, said
    log = tmp_path / "run.log"
    proc = procs.spawn([sys.executable, "-m", "trainwarden.agent.cli", "run", "--metrics-port", "0",
                        "--nproc-per-node", "2", "--max-restarts", "1", "--job", "held", "--", str(script)],
                       log=log, env=env)
    rc = proc.wait(240)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-3000:]
    before = re.findall(r"rank (\d) round 0 at step (\d+): held=(\d+)", text)
    assert sorted(r for r, _, _ in before) == ["0", "1"] and all(int(h) > 0 for _, _, h in before), text[-3000:]
    directory = tmp_path / "state" / "jobs" / "held" / "incidents"
    incidents = [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]
    hangs = [i for i in incidents if i["kind"] == "hang"]
    assert len(hangs) == 1 and hangs[0]["ranks"] == [1], incidents
    assert hangs[0]["state"] == "resolved" and "abort" in hangs[0]["action"], hangs[0]
    assert re.search(r"rank [01] round 1 at step 100", text), text[-3000:]
    print("hang evidence:", {k: hangs[0]["evidence"].get(k) for k in ("stalled_seconds", "timeout_seconds", "reason")})

"""Telemetry end to end: a real gRPC server on a unix socket, real runtime clients, a real gloo job."""

import os
import pickle
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from procs import wait_for
from trainwarden.agent.telemetry.job_telemetry import JobTelemetry, WorkerInfo
from trainwarden.agent.shared import telemetry_pb2 as pb
from trainwarden.agent.shared.peer_token import token_metadata
from trainwarden.agent.shared import telemetry_pb2_grpc
from trainwarden.agent.telemetry.server import SERVICE_NAME, TelemetryServer
from trainwarden.runtime.flight_recorder import FLIGHT_RECORDER_ENV
from trainwarden.runtime.session import init

pytestmark = pytest.mark.integration


def rank_state(js, job, rank):
    for j in js.snapshot(job):
        for r in j.ranks:
            if r.rank == rank:
                return r
    return None


def hello_bytes(srv, job="j"):
    """A Hello as a worker sends it: with a fresh peer token (this process's), since the agent requires one."""
    from trainwarden.runtime.agent_requests import fetch_peer_token

    token = fetch_peer_token(str(srv.socket_path))
    assert token, "the agent's .cred socket gave no token"
    return pb.WorkerMessage(hello=pb.Hello(job=job, rank=0, world_size=1, pid=1, peer_token=token)).SerializeToString()


def raw_stream(address, messages):
    """Send raw bytes on the Stream method, as a broken or hostile client would."""
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream("/trainwarden.v1.Telemetry/Stream")(iter(messages), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        return info.value.code()


@pytest.mark.timeout(60)
def test_malformed_oversized_and_helloless_streams_are_rejected_and_counted(server):
    srv, js = server
    assert oct(os.stat(srv.socket_path).st_mode & 0o777) == "0o660"

    assert raw_stream(srv.address, [hello_bytes(srv), b"\xff\xff\xff\xff garbage"]) == grpc.StatusCode.INVALID_ARGUMENT
    big = pb.WorkerMessage(goodbye=pb.Goodbye(reason="x" * 10_000)).SerializeToString()
    assert raw_stream(srv.address, [hello_bytes(srv), big]) == grpc.StatusCode.RESOURCE_EXHAUSTED
    step = pb.WorkerMessage(step=pb.Step(index=1, duration_seconds=0.1)).SerializeToString()
    assert raw_stream(srv.address, [step]) == grpc.StatusCode.INVALID_ARGUMENT
    assert raw_stream(srv.address, [b"\x0a\x03\xff\xfe\xfd"]) == grpc.StatusCode.INVALID_ARGUMENT
    rejected = js.rejected()
    assert (rejected["malformed"], rejected["oversized"], rejected["no_hello"]) == (2, 1, 1)

    # the agent keeps serving: health, status and a well-behaved worker
    with grpc.insecure_channel(srv.address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        rt = init("good", env={"RANK": "0", "WORLD_SIZE": "1"}, socket_path=str(srv.socket_path),
                  flush_interval_s=0.05)
        try:
            for i in range(3):
                with rt.step(i, tokens=8):
                    pass
            wait_for(lambda: (rank_state(js, "good", 0) or None) and rank_state(js, "good", 0).last_step == 2,
                     10, what="steps from the well-behaved worker")
            reply = telemetry_pb2_grpc.TelemetryStub(channel).Status(pb.StatusRequest(job="good"), timeout=5,
                                                                 metadata=token_metadata(str(srv.socket_path)))
            assert [j.job for j in reply.jobs] == ["good"] and reply.jobs[0].ranks[0].last_step == 2
            assert reply.jobs[0].ranks[0].connected
        finally:
            rt.close()


AGENT_SCRIPT = """
import sys, time
from trainwarden.agent.telemetry.job_telemetry import JobTelemetry
from trainwarden.agent.telemetry.server import TelemetryServer
TelemetryServer(sys.argv[1], JobTelemetry()).start()
print("serving", flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_worker_keeps_training_through_an_agent_crash_and_reconnects(tmp_path, procs):
    sock = tmp_path / "agent.sock"
    agent = procs.spawn([sys.executable, "-c", AGENT_SCRIPT, str(sock)], log=tmp_path / "agent.log")
    wait_for(lambda: "serving" in agent.log_path.read_text(), 60, what="the first agent")
    rt = init("j", env={"RANK": "1", "WORLD_SIZE": "2"}, socket_path=str(sock), flush_interval_s=0.05,
              backoff_max_s=0.5)
    stop, steps = threading.Event(), [0]

    def train():
        while not stop.is_set():
            with rt.step(steps[0], tokens=1):
                time.sleep(0.01)
            steps[0] += 1

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    try:
        wait_for(lambda: rt.stats["sent"] > 5, 20, what="the worker streaming to the first agent")
        procs.kill(agent, signal.SIGKILL)  # the socket file stays behind
        agent.wait(10)
        at_crash = steps[0]
        wait_for(lambda: steps[0] > at_crash + 20, 20, what="steps while the agent is down")
        js = JobTelemetry()
        srv = TelemetryServer(sock, js)  # removes the stale socket
        srv.start()
        try:
            wait_for(lambda: rank_state(js, "j", 1) is not None and rank_state(js, "j", 1).last_step > at_crash,
                     20, what="the worker reconnecting to the new agent")
            assert rt.stats["reconnects"] >= 1
            assert srv.send_command("j", 1, pb.AgentCommand(checkpoint_now=pb.CheckpointNow()))
            wait_for(lambda: rt.checkpoint_requested, 10, what="the command to arrive")

            srv.stop(0.5)  # a clean stop and a restart of the same server on the same path
            at_stop = steps[0]
            wait_for(lambda: not rank_state(js, "j", 1).connected, 10, what="the stream to end")
            srv.start()
            wait_for(lambda: rank_state(js, "j", 1).connected and rank_state(js, "j", 1).last_step > at_stop,
                     20, what="the worker reconnecting after a clean restart")
            with grpc.insecure_channel(srv.address) as channel:
                health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert health.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            stop.set()
            trainer.join(5)
            rt.close()
            srv.stop(0.5)
    finally:
        stop.set()


WORKER_SCRIPT = """
import os, sys, time, torch, torch.distributed as dist
import trainwarden.runtime
dist.init_process_group("gloo")
rank = dist.get_rank()
rt = trainwarden.runtime.init(mesh={"dp": 2}, flush_interval_s=0.05, fr_interval_s=0.2)
out = sys.argv[1]
compute = 0.15 if rank == 1 else 0.005  # rank 1 is the slow one: rank 0 waits for it in all_reduce
x = torch.ones(1000)
for step in range(int(sys.argv[2])):
    with rt.step(step, tokens=128):
        with rt.phase("forward"):
            time.sleep(compute)
        dist.all_reduce(x)
    if rt.take_checkpoint_request():
        open(os.path.join(out, f"checkpoint-request-rank{rank}"), "w").write(str(step))
rt.close()
dist.destroy_process_group()
"""


@pytest.mark.timeout(240)
def test_gloo_job_reports_steps_collectives_and_obeys_commands(tmp_path, procs, server):
    srv, js = server
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER_SCRIPT))
    env = dict(os.environ, TRAINWARDEN_AGENT_SOCKET=str(srv.socket_path), TRAINWARDEN_JOB="gloo2",
               OMP_NUM_THREADS="1", **FLIGHT_RECORDER_ENV)
    steps = 40
    job = procs.spawn([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       "--log-dir", str(tmp_path / "torchelastic"),
                       str(script), str(tmp_path), str(steps)], log=tmp_path / "torchrun.log", env=env)

    def both_at(step):
        ranks = [rank_state(js, "gloo2", r) for r in (0, 1)]
        return all(r is not None and r.last_step >= step for r in ranks)

    wait_for(lambda: both_at(5) or job.poll() is not None, 120, what="both ranks reporting steps")
    assert job.poll() is None, job.log_path.read_text()[-3000:]
    diag = tmp_path / "diag"
    for rank in (0, 1):
        assert srv.send_command("gloo2", rank, pb.AgentCommand(dump_diagnostics=pb.DumpDiagnostics(dir=str(diag))))
    assert srv.send_command("gloo2", 0, pb.AgentCommand(checkpoint_now=pb.CheckpointNow()))
    assert job.wait(120) == 0, job.log_path.read_text()[-3000:]

    (snap,) = js.snapshot("gloo2")
    assert snap.mesh == {"dp": 2} and snap.world_size == 2
    r0, r1 = snap.ranks
    for r in (r0, r1):
        assert r.last_step == steps - 1 and r.step_count == steps and r.tokens_total == 128 * steps
        (ar,) = [c for c in r.collectives if c.op == "all_reduce"]
        assert ar.count >= steps and ar.last_seq_id >= steps
        assert not r.connected  # the worker said goodbye and hung up
    # rank 0 waits for slow rank 1 (matched arrivals: departure - own arrival). Ideally 30x apart; a busy machine
    # adds scheduling delay to both ranks' compute, so the margin is wide.
    wait0, wait1 = r0.wait_seconds_by_op["all_reduce"], r1.wait_seconds_by_op["all_reduce"]
    print(f"wait rank0 {wait0:.3f}s rank1 {wait1:.3f}s; compute rank0 {r0.compute_seconds_total:.3f}s "
          f"rank1 {r1.compute_seconds_total:.3f}s; steps {r0.step_seconds_total:.3f}s {r1.step_seconds_total:.3f}s")
    assert wait0 > 3 * wait1, (wait0, wait1)
    assert r1.compute_seconds_total > 2 * r0.compute_seconds_total, (r1.compute_seconds_total,
                                                                     r0.compute_seconds_total)

    for rank in (0, 1):
        assert "Thread" in (diag / f"rank{rank}.stacks").read_text()
        trace = pickle.loads((diag / f"rank{rank}.fr").read_bytes())
        assert any(e["profiling_name"] == "gloo:all_reduce" for e in trace["entries"])
    assert (tmp_path / "checkpoint-request-rank0").exists()
    assert not (tmp_path / "checkpoint-request-rank1").exists()


@pytest.mark.timeout(30)
def test_an_inconsistent_arrivals_batch_is_refused_whole_and_counted(server):
    srv, js = server
    info = WorkerInfo(job="arr", rank=0, world_size=2, pid=7)
    js.connect(info)
    bad = pb.WorkerMessage(collectives=pb.Collectives(arrivals=pb.Arrivals(
        groups=["5"], group=[0, 3], seq=[1, 2], enqueued_ns=[10, 20])))          # group index 3 of 1
    srv._apply(info, bad)
    worse = pb.WorkerMessage(collectives=pb.Collectives(arrivals=pb.Arrivals(
        groups=["5"], group=[0], seq=[1], enqueued_ns=[10], members=[pb.GroupMembers(name="5", ranks=[0, 9])])))
    srv._apply(info, worse)                                                      # rank 9 of a world of 2
    assert js.rejected()["invalid"] == 2
    assert rank_state(js, "arr", 0).connected                                     # the stream lives on


@pytest.mark.timeout(30)
def test_a_training_thread_report_is_kept_aged_and_a_malformed_one_refused(server):
    srv, js = server
    info = WorkerInfo(job="still", rank=0, world_size=1, pid=7)
    js.connect(info)
    srv._apply(info, pb.WorkerMessage(training_thread=pb.TrainingThread(still_seconds=3.0,
                                                                        collective_pending_seconds=2.5)))
    state = rank_state(js, "still", 0)
    assert state.still_seconds >= 3.0 and 2.5 <= state.collective_pending_seconds < state.still_seconds
    for bad in (float("nan"), -1.0, float("inf")):
        srv._apply(info, pb.WorkerMessage(training_thread=pb.TrainingThread(still_seconds=bad)))
    assert js.rejected()["invalid"] == 3 and rank_state(js, "still", 0).still_seconds >= 3.0  # kept
    srv._apply(info, pb.WorkerMessage(training_thread=pb.TrainingThread()))  # it moves again
    state = rank_state(js, "still", 0)
    assert state.still_seconds == 0 and state.collective_pending_seconds == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("job", ["MyJob", "x" * 64, "a/b"])
def test_a_job_name_the_state_directory_would_refuse_is_refused_at_the_door(server, job):
    """One job-name rule at every entry: a name the watchdog could not make a state directory of used to
    be accepted here, and every hang of that job then failed to record and to abort."""
    srv, js = server
    hello = pb.WorkerMessage(hello=pb.Hello(job=job, rank=0, world_size=1, pid=1)).SerializeToString()
    assert raw_stream(srv.address, [hello]) == grpc.StatusCode.INVALID_ARGUMENT
    assert js.snapshot() == () and js.rejected()["invalid"] == 1


@pytest.mark.timeout(30)
def test_the_runtime_says_what_is_wrong_with_its_job_name_and_trains_on(server, caplog):
    srv, _ = server
    rt = init(env={"TRAINWARDEN_AGENT_SOCKET": str(srv.socket_path), "TRAINWARDEN_JOB": "MyJob", "RANK": "0",
                   "WORLD_SIZE": "1"})
    assert not rt.enabled and "job name 'MyJob' is invalid" in caplog.text and "TRAINWARDEN_JOB" in caplog.text
    with rt.step(1):
        pass


@pytest.mark.timeout(60)
def test_the_agent_learns_a_workers_pid_from_the_kernel_not_from_its_hello(server, tmp_path):
    srv, js = server
    assert oct(os.stat(str(srv.socket_path) + ".cred").st_mode & 0o777) == "0o660"
    # a real runtime client fetches a token first: its pid is verified
    rt = init(env={"TRAINWARDEN_AGENT_SOCKET": str(srv.socket_path), "TRAINWARDEN_JOB": "real", "RANK": "0",
                   "WORLD_SIZE": "1"})
    try:
        wait_for(lambda: rank_state(js, "real", 0), 10, what="the runtime's stream")
        real = rank_state(js, "real", 0)
        assert real.verified and real.pid == os.getpid() and real.started > 0
    finally:
        rt.close()
    # a Hello that only claims a pid is refused by default (tests/integration/test_stream_identity.py); where
    # the agent allows unverified streams it streams, unverified: the agent will never signal it
    claim = pb.WorkerMessage(hello=pb.Hello(job="claim", rank=0, world_size=1, pid=1))
    assert raw_stream(srv.address, [claim.SerializeToString()]) == grpc.StatusCode.UNAUTHENTICATED
    done = threading.Event()

    def messages():
        yield claim
        done.wait(10)

    lenient = TelemetryServer(tmp_path / "lenient.sock", js, allow_unverified=True)
    lenient.start()
    with grpc.insecure_channel(lenient.address) as channel:
        call = channel.stream_stream("/trainwarden.v1.Telemetry/Stream",
                                     request_serializer=pb.WorkerMessage.SerializeToString)(messages(), timeout=20)
        try:
            wait_for(lambda: rank_state(js, "claim", 0), 10, what="the claimed stream")
            claimed = rank_state(js, "claim", 0)
            assert not claimed.verified and claimed.pid == 1
        finally:
            done.set()
            call.cancel()
            lenient.stop(0.5)
    # a token nobody was given is refused outright
    forged = pb.WorkerMessage(hello=pb.Hello(job="forged", rank=0, world_size=1, pid=1, peer_token="0" * 32))
    assert raw_stream(srv.address, [forged.SerializeToString()]) == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.timeout(60)
def test_a_forked_child_goes_quiet_and_leaves_the_workers_stream_alone(server):
    """A DataLoader worker or a user's ``os.fork`` inherits a gRPC client whose threads did not survive the
    fork. Before the fix the child's session still claimed to be live: its steps went into a queue nobody
    sends and ``close`` (also run by its exit hook) waited out its whole timeout on a thread that does not
    exist. Now the child is a no-op session and never touches the parent's gRPC state."""
    srv, js = server
    rt = init("forky", env={"RANK": "0", "WORLD_SIZE": "1"}, socket_path=str(srv.socket_path), flush_interval_s=0.05)
    try:
        with rt.step(1):
            pass
        wait_for(lambda: (rank_state(js, "forky", 0) or None) and rank_state(js, "forky", 0).last_step == 1, 10,
                 what="the parent's first step")
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what its session says, use it as a careless script would, leave
            try:
                with rt.step(99):
                    pass
                before = rt.enabled
                rt.close(timeout=30)
                os.write(write_end, pickle.dumps((before, rt.enabled, rt.stats)))
            finally:
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            enabled_in_child, enabled_after_close, stats = pickle.loads(pipe.read())
        os.waitpid(pid, 0)
        assert (enabled_in_child, enabled_after_close, stats["sent"]) == (False, False, 0)
        # the parent's stream is untouched: no goodbye, and its next steps arrive
        with rt.step(2):
            pass
        wait_for(lambda: rank_state(js, "forky", 0).last_step == 2, 10, what="the parent's step after the fork")
        assert rank_state(js, "forky", 0).connected and js.ended_streams("forky", since=0) == []
    finally:
        rt.close()


@pytest.mark.timeout(60)
def test_a_commit_is_asked_of_the_agent_which_sees_the_streams_pid_and_may_refuse(server, tmp_path):
    """The Commit RPC of fenced rounds: the guard decides with the pid of the rank's own stream (not a pid
    the request claims); no guard allows; an unusable answer refuses; no agent at all refuses nothing."""
    srv, js = server
    rt = init("j", socket_path=str(srv.socket_path), env={"RANK": "0", "WORLD_SIZE": "1"})
    try:
        wait_for(lambda: rank_state(js, "j", 0) is not None and rank_state(js, "j", 0).connected, 20,
                 what="the worker's stream")
        assert rt.commit_refusal(5, "/ckpt/step-5", 100) is None  # no guard: a one-node job
        asked = []

        def guard(job, rank, pid, step, path, nbytes):
            asked.append((job, rank, pid, step, path, nbytes))
            return None if step < 10 else "the job's current round is round 4 of generation 0"

        srv.commit_guard = guard
        assert rt.commit_refusal(5, "/ckpt/step-5", 100) is None
        assert rt.commit_refusal(10, "/ckpt/step-10", 100) == "the job's current round is round 4 of generation 0"
        assert asked[0] == ("j", 0, os.getpid(), 5, "/ckpt/step-5", 100)

        def broken(*args):
            raise RuntimeError("etcd client closed")

        srv.commit_guard = broken
        assert "could not check the job's round: etcd client closed" in rt.commit_refusal(11)
    finally:
        rt.close()
    lonely = init("j", socket_path=str(tmp_path / "nobody.sock"), env={"RANK": "0", "WORLD_SIZE": "1"})
    try:
        assert lonely.commit_refusal(5) is None
    finally:
        lonely.close()


def _wait_connected(rt, js, job: str) -> None:
    """One step (rank 0), then wait until the agent has the worker's stream."""
    with rt.step(1):
        pass
    wait_for(lambda: (rank_state(js, job, 0) or None) and rank_state(js, job, 0).connected, 10, what="the stream")


def _wakeups(native_id: int) -> int:
    status = Path(f"/proc/self/task/{native_id}/status").read_text()
    return sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches:" in line)


@pytest.mark.timeout(60)
def test_the_sender_thread_sleeps_until_the_agent_speaks(server):
    """gRPC's synchronous stack waits for a response in 0.1 s slices, so that a main thread blocked in a call
    still runs its signal handlers (grpc/grpc#19464). The sender thread waited that way for the agent's
    commands all the time: ten wake-ups a second, each taking the GIL from training (issue 14). It now
    sleeps until a command, the end of the call or a cancel wakes it; other threads keep gRPC's slices."""
    from grpc import _common

    srv, js = server
    rt = init("quiet", env={"RANK": "0", "WORLD_SIZE": "1"}, socket_path=str(srv.socket_path))
    try:
        _wait_connected(rt, js, "quiet")
        sender = rt._client._thread.native_id
        time.sleep(0.5)
        before, sent0 = _wakeups(sender), rt._client.sent
        time.sleep(2.0)  # the agent says nothing: gRPC's own wait woke the thread 20 times (measured)
        woke, sent = _wakeups(sender) - before, rt._client.sent - sent0
        # what still wakes it: gRPC notifies the call's condition on every completed send, so each message the
        # stream sends (a Flight Recorder read's collectives) costs a few wake-ups (1-3 messages: 1-11 seen)
        assert sent <= 4 and woke <= 2 + 4 * sent, (woke, sent)
        assert srv.send_command("quiet", 0, pb.AgentCommand(checkpoint_now=pb.CheckpointNow()))
        wait_for(lambda: rt.checkpoint_requested, 10, what="the command to wake the sender")
        # any other thread still waits in gRPC's slices
        timeouts = []
        _common.wait(lambda timeout: timeouts.append(timeout), lambda: len(timeouts) == 2)
        assert timeouts == [_common.MAXIMUM_WAIT_TIMEOUT] * 2
    finally:
        rt.close()
    assert not rt._client._thread.is_alive()  # the end of the call woke it


@pytest.mark.timeout(60)
def test_the_agents_read_pace_reaches_the_flight_recorder_schedule_and_a_new_stream_starts_afresh(server):
    srv, js = server
    rt = init("paced", env={"RANK": "0", "WORLD_SIZE": "1"}, socket_path=str(srv.socket_path))
    try:
        _wait_connected(rt, js, "paced")
        schedule = rt._client._schedule
        assert schedule.interval_s == 1.5
        assert srv.send_command("paced", 0, pb.AgentCommand(read_pace=pb.ReadPace(max_period_seconds=3.0)))
        wait_for(lambda: schedule.interval_s == 3.0, 10, what="the read pace to apply")
        assert not rt.checkpoint_requested and rt.poll_command() is None  # the client's own: not the loop's
        # past the cap: the longest the client accepts; 0: its own pace
        assert srv.send_command("paced", 0, pb.AgentCommand(read_pace=pb.ReadPace(max_period_seconds=600)))
        wait_for(lambda: schedule.interval_s == 30.0, 10, what="the capped pace")
        assert srv.send_command("paced", 0, pb.AgentCommand(read_pace=pb.ReadPace()))
        wait_for(lambda: schedule.interval_s == 1.5, 10, what="the worker's own pace")
        assert srv.send_command("paced", 0, pb.AgentCommand(read_pace=pb.ReadPace(max_period_seconds=3.0)))
        wait_for(lambda: schedule.interval_s == 3.0, 10, what="the read pace to apply")
        # the agent restarts: the new one has told the worker nothing, so the worker reads at its own pace
        srv.stop(0.5)
        srv2 = TelemetryServer(srv.socket_path, js, max_message_bytes=4096)
        srv2.start()
        try:
            with rt.step(2):
                pass
            wait_for(lambda: schedule.interval_s == 1.5, 20, what="a new stream to reset the pace")
        finally:
            srv2.stop(0.5)
    finally:
        rt.close()


@pytest.mark.timeout(60)
def test_a_checkpoint_event_is_sent_at_once_not_with_the_next_batch_of_steps(server):
    srv, js = server
    rt = init("ckpt", env={"RANK": "0", "WORLD_SIZE": "1"}, socket_path=str(srv.socket_path), flush_interval_s=60.0,
               fr_interval_s=60.0)
    try:
        _wait_connected(rt, js, "ckpt")
        rt.checkpoint_event("save_start", 1)
        # steps go in batches a minute apart here; the checkpoint stage wakes the sender, and the step queued
        # before it goes along in order
        wait_for(lambda: rank_state(js, "ckpt", 0).checkpoint_stage == "save_start", 10, what="the event")
        assert rank_state(js, "ckpt", 0).last_step == 1
    finally:
        rt.close()

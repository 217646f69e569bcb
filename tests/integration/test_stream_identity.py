"""A telemetry stream is who the kernel says it is (issue 30, item 3): a real gRPC server on a real unix socket,
a real worker session, and an attacker that is really another uid.

The attack the issue names: any process that can reach the agent's socket said Hello as job J rank 0 and its
stream replaced the worker's, so it could report step 999999 (and `trainwarden status` showed it), commit for the
rank, or stream with no credentials at all. The attacker here is a child of this (root) test that imports what it
needs, then drops to uid ``nobody`` with ``os.setresuid`` before it connects, so the kernel's SO_PEERCRED names
that uid; it keeps gid 0, standing for a second user in the socket's group. No interpreter access for ``nobody``
is needed (Python lives under /root, mode 0700), and nothing is skipped: the test needs root, which the suite has.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import grpc
import pytest

from procs import wait_for
from trainwarden.agent.shared import telemetry_pb2 as pb
from trainwarden.agent.shared.peer_token import token_metadata
from trainwarden.agent.shared import telemetry_pb2_grpc
from trainwarden.agent.shared.contract import STREAM_METHOD
from trainwarden.agent.telemetry.job_telemetry import JobTelemetry, WorkerInfo
from trainwarden.agent.telemetry.server import TelemetryServer
from trainwarden.runtime.agent_requests import fetch_peer_token
from trainwarden.runtime.session import init

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NOBODY = 65534

ATTACKER = textwrap.dedent("""
    import json, os, sys
    import grpc
    from trainwarden.agent.shared import telemetry_pb2 as pb
    from trainwarden.agent.shared.contract import STREAM_METHOD
    from trainwarden.runtime.agent_requests import ask_commit, fetch_peer_token

    sock, job, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    # load gRPC's lazily imported parts while this process may still read the interpreter's files
    with grpc.insecure_channel("unix:" + sock + ".absent") as warm:
        try:
            warm.unary_unary(STREAM_METHOD)(b"", timeout=0.2)
        except grpc.RpcError:
            pass
    os.setresuid(uid, uid, uid)  # from here on the kernel says uid `uid` on every socket this process opens

    def stream(hello, *records):
        # Hello and records, then the end of the stream: ("OK", "") when the agent read them all
        messages = [pb.WorkerMessage(hello=hello), *records]
        with grpc.insecure_channel("unix:" + sock) as channel:
            call = channel.stream_stream(STREAM_METHOD, request_serializer=pb.WorkerMessage.SerializeToString,
                                         response_deserializer=pb.AgentCommand.FromString)(iter(messages), timeout=30)
            try:
                for _ in call:
                    pass
                return "OK", ""
            except grpc.RpcError as exc:
                return exc.code().name, exc.details() or ""

    forged_step = pb.WorkerMessage(step=pb.Step(index=999999, duration_seconds=0.1))
    out = {"uid": os.getuid()}
    token = fetch_peer_token(sock)
    out["token"] = bool(token)
    out["rank0"] = stream(pb.Hello(job=job, rank=0, world_size=2, pid=os.getpid(), peer_token=token), forged_step)
    out["rank1"] = stream(pb.Hello(job=job, rank=1, world_size=2, pid=os.getpid(),
                                   peer_token=fetch_peer_token(sock)), forged_step)
    reply = ask_commit(sock, pb.CommitRequest(job=job, rank=0, step=999999, path="/tmp/evil", bytes=1), timeout=10)
    out["commit"] = [reply.allowed, reply.reason] if reply is not None else None
    # its own job is its own: the same uid streams as itself (the socket was reachable all along)
    out["own"] = stream(pb.Hello(job="mine", rank=0, world_size=1, pid=os.getpid(), peer_token=fetch_peer_token(sock)),
                        pb.WorkerMessage(step=pb.Step(index=7, duration_seconds=0.1)))
    out["tokenless"] = stream(pb.Hello(job="other", rank=0, world_size=1, pid=os.getpid()))
    print(json.dumps(out), flush=True)
""")


@pytest.fixture
def shared_server():
    """A server whose socket a second user in its group can reach: the directory is group-traversable (pytest's
    tmp_path is under a 0700 directory of root's)."""
    top = Path(tempfile.mkdtemp(prefix="tw-ident-", dir="/tmp"))
    os.chmod(top, 0o750)
    js = JobTelemetry()
    srv = TelemetryServer(top / "run" / "agent.sock", js)
    srv.start()
    try:
        yield srv, js
    finally:
        srv.stop(0.5)
        shutil.rmtree(top, ignore_errors=True)


def _rank(js, job, rank):
    for j in js.snapshot(job):
        for r in j.ranks:
            if r.rank == rank:
                return r
    return None


def _status(srv, job):
    with grpc.insecure_channel(srv.address) as channel:
        return telemetry_pb2_grpc.TelemetryStub(channel).Status(pb.StatusRequest(job=job), timeout=5,
                                                               metadata=token_metadata(str(srv.socket_path)))


def test_another_uid_cannot_take_a_rank_report_a_step_or_commit_for_it(shared_server, procs, tmp_path, caplog):
    assert os.geteuid() == 0, "this test drops a child to another uid: the suite runs as root"
    srv, js = shared_server
    rt = init("victim", socket_path=str(srv.socket_path), env={"RANK": "0", "WORLD_SIZE": "2"}, flush_interval_s=0.05)
    try:
        for i in range(3):
            with rt.step(i):
                pass
        wait_for(lambda: (_rank(js, "victim", 0) or None) and _rank(js, "victim", 0).last_step == 2, 20,
                 what="the worker's steps")
        assert _rank(js, "victim", 0).verified

        script = tmp_path / "attacker.py"
        script.write_text(ATTACKER)
        proc = procs.spawn([sys.executable, str(script), str(srv.socket_path), "victim", str(NOBODY)],
                           log=tmp_path / "attacker.log")
        assert proc.wait(90) == 0, proc.log_path.read_text()
        out = json.loads(proc.log_path.read_text().strip().splitlines()[-1])

        assert out["uid"] == NOBODY and out["token"], out  # the kernel vouched for the attacker: a real second uid
        assert out["own"] == ["OK", ""], out  # and it could reach the socket and stream as itself
        wait_for(lambda: (_rank(js, "mine", 0) or None) and _rank(js, "mine", 0).last_step == 7, 10,
                 what="the second uid's own job")
        assert out["rank0"][0] == "PERMISSION_DENIED" and f"a stream of uid {NOBODY}" in out["rank0"][1], out
        assert "streams as uid 0" in out["rank0"][1]
        assert out["rank1"][0] == "PERMISSION_DENIED", out  # a rank of the job not connected yet: the job's uid's
        assert out["commit"][0] is False and "may not commit for it" in out["commit"][1], out
        assert out["tokenless"][0] == "UNAUTHENTICATED" and "--allow-unverified-streams" in out["tokenless"][1], out
        assert f"uid {NOBODY}" in caplog.text and "uid 0" in caplog.text  # logged with both uids

        # the job view is the worker's: its pid on rank 0, no step 999999, and its stream still speaks
        assert _rank(js, "victim", 0).pid == os.getpid() and _rank(js, "victim", 1) is None
        with rt.step(3):
            pass
        wait_for(lambda: _rank(js, "victim", 0).last_step == 3, 20, what="the worker's step after the attack")
        status = _status(srv, "victim")
        assert status.jobs[0].last_step == 3 and [r.pid for r in status.jobs[0].ranks] == [os.getpid()]
        assert _rank(js, "victim", 0).connected
        assert rt.commit_refusal(3, "/ckpt/step-3", 10) is None  # the rank's own process still commits

        # the other way round, through the real runtime: root's worker may not speak for nobody's job either,
        # and says so once, training on
        other = init("mine", socket_path=str(srv.socket_path), env={"RANK": "0", "WORLD_SIZE": "1"})
        try:
            with other.step(8):
                pass
            wait_for(lambda: "the node agent refuses this worker's telemetry (PERMISSION_DENIED" in caplog.text, 20,
                     what="the refused worker's warning")
            assert _rank(js, "mine", 0).last_step == 7
        finally:
            other.close()
    finally:
        rt.close()


def _hello_stream(srv, hello):
    """Say ``hello`` on a raw stream and end it; the call's status code name ("OK": the agent took it)."""
    with grpc.insecure_channel(srv.address) as channel:
        call = channel.stream_stream(STREAM_METHOD, request_serializer=pb.WorkerMessage.SerializeToString,
                                     response_deserializer=pb.AgentCommand.FromString)(
            iter([pb.WorkerMessage(hello=hello)]), timeout=30)
        try:
            list(call)
            return "OK"
        except grpc.RpcError as exc:
            return exc.code().name


def test_a_tokenless_hello_is_refused_by_default_and_allowed_only_when_configured(tmp_path):
    js = JobTelemetry()
    strict = TelemetryServer(tmp_path / "strict.sock", js)
    strict.start()
    try:
        assert _hello_stream(strict, pb.Hello(job="old", rank=0, world_size=1, pid=1)) == "UNAUTHENTICATED"
        assert js.snapshot("old") == () and js.rejected()["unverified"] == 1
    finally:
        strict.stop(0.5)
    js = JobTelemetry()
    lenient = TelemetryServer(tmp_path / "lenient.sock", js, allow_unverified=True)
    lenient.start()
    try:
        assert _hello_stream(lenient, pb.Hello(job="old", rank=0, world_size=1, pid=1)) == "OK"
        assert not _rank(js, "old", 0).verified
        # a verified worker takes its rank over; from then on an unverified stream may not speak for the job
        token = fetch_peer_token(str(lenient.socket_path))
        assert _hello_stream(lenient, pb.Hello(job="old", rank=0, world_size=1, pid=1, peer_token=token)) == "OK"
        assert _rank(js, "old", 0).verified and _rank(js, "old", 0).pid == os.getpid()
        assert _hello_stream(lenient, pb.Hello(job="old", rank=0, world_size=1, pid=1)) == "PERMISSION_DENIED"
        assert _rank(js, "old", 0).verified and js.rejected()["identity"] == 1
    finally:
        lenient.stop(0.5)


def test_a_replaced_streams_late_records_are_dropped(tmp_path):
    """Records count only while their stream holds the rank: a stream a newer one replaced (a restarted worker)
    may still have a step in flight, and it is not the rank's any more."""

    class Handle:  # what the server keeps per stream: its command queue (and its identity)
        def __init__(self):
            self.commands = queue.Queue(8)

    js = JobTelemetry()
    srv = TelemetryServer(tmp_path / "a.sock", js)
    info = WorkerInfo(job="late", rank=0, world_size=1, pid=os.getpid())
    js.connect(info)
    stale, current = Handle(), Handle()
    srv._streams[("late", 0)] = current  # a newer stream of the rank said Hello
    srv._read(iter([pb.WorkerMessage(step=pb.Step(index=50, duration_seconds=0.1))]), info, stale)
    assert _rank(js, "late", 0).last_step == -1
    srv._read(iter([pb.WorkerMessage(step=pb.Step(index=51, duration_seconds=0.1))]), info, current)
    assert _rank(js, "late", 0).last_step == 51


STREAMER = textwrap.dedent("""
    import json, os, sys
    import grpc
    from trainwarden.agent.shared import telemetry_pb2 as pb
    from trainwarden.agent.shared.contract import STREAM_METHOD
    from trainwarden.runtime.agent_requests import fetch_peer_token

    sock, job = sys.argv[1], sys.argv[2]
    hello = pb.Hello(job=job, rank=0, world_size=1, pid=os.getpid(), peer_token=fetch_peer_token(sock))
    with grpc.insecure_channel("unix:" + sock) as channel:
        call = channel.stream_stream(STREAM_METHOD, request_serializer=pb.WorkerMessage.SerializeToString,
                                     response_deserializer=pb.AgentCommand.FromString)(
            iter([pb.WorkerMessage(hello=hello), pb.WorkerMessage(step=pb.Step(index=5, duration_seconds=0.1))]),
            timeout=30)
        try:
            for _ in call:
                pass
            print(json.dumps(["OK", ""]), flush=True)
        except grpc.RpcError as exc:
            print(json.dumps([exc.code().name, exc.details() or ""]), flush=True)
""")


def test_a_launchers_job_takes_streams_only_from_its_descendants(tmp_path, procs):
    """issue 30, item 3: the agent knows a job's launcher (`trainwarden run`'s torchrun, a daemon's launcher) and
    accepts, for that job, only processes that descend from it, even of the same uid."""
    from trainwarden.agent.incidents.store import IncidentStore
    from trainwarden.agent.node.actions import AgentActions

    js = JobTelemetry()
    srv = TelemetryServer(tmp_path / "agent.sock", js)
    actions = AgentActions(srv, js, IncidentStore(state_dir=lambda job: tmp_path / job), node="n0")
    srv.stream_guard = actions.stream_refusal
    srv.start()
    try:
        streamer = tmp_path / "streamer.py"
        streamer.write_text(STREAMER)
        # the launcher: a process that starts the streamer as its child once told to (a line on stdin)
        launcher_code = ("import subprocess, sys; sys.stdin.readline(); "
                         f"sys.exit(subprocess.run([sys.executable, {str(streamer)!r}, {str(srv.socket_path)!r}, "
                         "'lj']).returncode)")
        launcher = subprocess.Popen([sys.executable, "-c", launcher_code], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            actions.register_launcher("lj", launcher.pid)
            outsider = subprocess.run([sys.executable, str(streamer), str(srv.socket_path), "lj"],
                                      capture_output=True, text=True, timeout=60)
            code, detail = json.loads(outsider.stdout.strip().splitlines()[-1])
            assert code == "PERMISSION_DENIED" and f"launcher pid {launcher.pid}" in detail, (code, detail)
            assert "does not descend from it" in detail and _rank(js, "lj", 0) is None
            out, _ = launcher.communicate("go\n", timeout=60)
            assert json.loads(out.strip().splitlines()[-1]) == ["OK", ""]  # its own child streams
            wait_for(lambda: (_rank(js, "lj", 0) or None) and _rank(js, "lj", 0).last_step == 5, 10,
                     what="the launcher's child's step")
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait(10)
        actions.forget_launcher("lj", launcher.pid)  # the launcher ended: the name is free again
        again = subprocess.run([sys.executable, str(streamer), str(srv.socket_path), "lj"], capture_output=True,
                               text=True, timeout=60)
        assert json.loads(again.stdout.strip().splitlines()[-1]) == ["OK", ""]
        other = subprocess.run([sys.executable, str(streamer), str(srv.socket_path), "unrelated"],
                               capture_output=True, text=True, timeout=60)
        assert json.loads(other.stdout.strip().splitlines()[-1]) == ["OK", ""]  # a job without a launcher here
    finally:
        srv.stop(0.5)


READER = textwrap.dedent("""
    import json, os, sys
    import grpc
    from trainwarden.agent.node.endpoints import fetch_status
    from trainwarden.agent.shared import telemetry_pb2 as pb
    from trainwarden.agent.shared.contract import STATUS_METHOD, STREAM_METHOD
    from trainwarden.runtime.agent_requests import ask_checkpoint_record, fetch_peer_token

    sock, uid = sys.argv[1], int(sys.argv[2])
    with grpc.insecure_channel("unix:" + sock + ".absent") as warm:  # gRPC's lazy imports while files are readable
        try:
            warm.unary_unary(STREAM_METHOD)(b"", timeout=0.2)
        except grpc.RpcError:
            pass
    os.setresuid(uid, uid, uid)
    out = {"uid": os.getuid()}
    with grpc.insecure_channel("unix:" + sock) as channel:  # its own job: a stream of its own, left open
        hello = pb.Hello(job="mine", rank=0, world_size=1, pid=os.getpid(), peer_token=fetch_peer_token(sock))
        messages = iter([pb.WorkerMessage(hello=hello), pb.WorkerMessage(step=pb.Step(index=1, duration_seconds=0.1))])
        call = channel.stream_stream(STREAM_METHOD, request_serializer=pb.WorkerMessage.SerializeToString,
                                     response_deserializer=pb.AgentCommand.FromString)(messages, timeout=30)
        try:
            for _ in call:
                pass
        except grpc.RpcError as exc:
            out["stream"] = exc.code().name
    out["status"] = sorted(j.job for j in fetch_status(sock).jobs)
    out["status_victim"] = [j.job for j in fetch_status(sock, "victim").jobs]
    out["record_victim"] = list(ask_checkpoint_record(sock, "victim"))
    out["record_mine"] = list(ask_checkpoint_record(sock, "mine"))
    with grpc.insecure_channel("unix:" + sock) as channel:
        tokenless = channel.unary_unary(STATUS_METHOD, request_serializer=pb.StatusRequest.SerializeToString,
                                        response_deserializer=pb.StatusReply.FromString)(pb.StatusRequest(), timeout=5)
    out["tokenless"] = sorted(j.job for j in tokenless.jobs)
    print(json.dumps(out), flush=True)
""")


def test_status_and_checkpoint_records_show_another_uid_only_its_own_jobs(shared_server, procs, tmp_path):
    """Reads through the socket (issue 44, round 2): before, any member of the socket's group read every job's
    status (ranks, pids, hosts, steps) and etcd's checkpoint record of any job. Now a caller proves its uid with a
    peer token and sees its own jobs; root sees all; a caller without a token sees no owned job."""
    srv, js = shared_server
    srv.checkpoint_record = lambda job: {"step": 42, "path": f"/ckpt/{job}/step-42"}
    rt = init("victim", socket_path=str(srv.socket_path), env={"RANK": "0", "WORLD_SIZE": "1"}, flush_interval_s=0.05)
    try:
        with rt.step(0):
            pass
        wait_for(lambda: (_rank(js, "victim", 0) or None) and _rank(js, "victim", 0).last_step == 0, 20,
                 what="root's worker's step")
        script = tmp_path / "reader.py"
        script.write_text(READER)
        proc = procs.spawn([sys.executable, str(script), str(srv.socket_path), str(NOBODY)],
                           log=tmp_path / "reader.log")
        assert proc.wait(90) == 0, proc.log_path.read_text()
        out = json.loads(proc.log_path.read_text().strip().splitlines()[-1])

        assert out["uid"] == NOBODY and "stream" not in out, out
        assert out["status"] == ["mine"], out  # before: ["mine", "victim"]
        assert out["status_victim"] == [], out
        assert out["record_victim"][0] is None and "another uid" in out["record_victim"][2], out  # before: 42
        assert out["record_mine"][:2] == [42, "/ckpt/mine/step-42"], out
        assert out["tokenless"] == [], out
        # root (an operator with sudo) still sees every job
        assert sorted(j.job for j in _status(srv, "").jobs) == ["mine", "victim"]
    finally:
        rt.close()

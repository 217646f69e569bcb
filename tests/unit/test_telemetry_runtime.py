"""Runtime side of telemetry without an agent: the no-op session, drop-oldest queueing, commands."""

import pickle
import subprocess
import sys
import textwrap
import time

import pytest

from trainwarden.agent.shared import telemetry_pb2 as pb
from trainwarden.runtime import EXIT_ABORTED, Session, init
from trainwarden.runtime.flight_recorder import FlightRecorder
from trainwarden.runtime.agent_client import STEP_RECORD, ClientConfig, TelemetryClient


class Boom(Exception):
    pass


@pytest.mark.timeout(20)
def test_without_an_agent_socket_the_session_is_a_no_op_with_the_same_api():
    rt = init(env={"RANK": "3", "WORLD_SIZE": "4", "TRAINWARDEN_JOB": "j"})
    assert not rt.enabled and (rt.job, rt.rank, rt.world_size) == ("j", 3, 4)
    for i in range(3):
        with rt.step(i, tokens=10):
            with rt.phase("forward"):
                pass
    rt.checkpoint_event("committed", 2, 1.0, 100)
    with pytest.raises(ValueError, match="unknown checkpoint stage"):
        rt.checkpoint_event("half-written", 2)
    with pytest.raises(Boom):  # the training step's own exception passes through
        with rt.step(3):
            raise Boom()
    assert rt.poll_command() is None and not rt.take_checkpoint_request()
    assert rt.stats == {"dropped": 0, "reconnects": 0, "sent": 0, "drains": 0, "held": 0, "fr_reads": 0, "fr_read_cpu_s": 0.0,
                        "fr_missed": 0, "still_reads": 0, "still_read_cpu_s": 0.0}
    rt.close()


@pytest.mark.timeout(20)
def test_full_queue_drops_the_oldest_records_and_counts_them(tmp_path):
    client = TelemetryClient(ClientConfig(socket_path=str(tmp_path / "absent.sock"), queue_size=16),
                             pb.Hello(job="j"), on_command=lambda c: None)
    for i in range(100):  # the sender thread is not started: nothing drains
        client.record((STEP_RECORD, i, 0, 1, 0, None))
    assert client.dropped == 84
    assert [item[1] for item in client._queue] == list(range(84, 100))
    messages = client._drain()
    assert [s.index for m in messages if m.WhichOneof("record") == "steps" for s in m.steps.steps] == list(range(84, 100))
    assert [m.stats.dropped for m in messages if m.WhichOneof("record") == "stats"] == [84]


@pytest.mark.timeout(20)
def test_step_never_raises_when_telemetry_breaks():
    rt = Session(job="j", rank=0, world_size=1, client_config=None)

    class Broken:
        def record(self, item):
            raise RuntimeError("queue is gone")

    rt._client = Broken()
    with rt.step(1, tokens=5):
        with rt.phase("forward"):
            pass


@pytest.mark.timeout(20)
def test_agent_commands_are_handled_and_polled(tmp_path):
    trace = b"\x80\x04fake-trace"
    rt = Session(job="j", rank=2, world_size=4, client_config=None,
                 flight_recorder=FlightRecorder(dump=lambda include_stacks: trace))
    rt._on_command(pb.AgentCommand(checkpoint_now=pb.CheckpointNow()))
    rt._on_command(pb.AgentCommand(dump_diagnostics=pb.DumpDiagnostics(dir=str(tmp_path / "diag"))))
    assert rt.checkpoint_requested and rt.take_checkpoint_request() and not rt.checkpoint_requested
    assert rt.poll_command().kind == "checkpoint_now"
    command = rt.poll_command()
    assert (command.kind, command.argument) == ("dump_diagnostics", str(tmp_path / "diag"))
    assert rt.poll_command() is None
    stacks = (tmp_path / "diag" / "rank2.stacks").read_text()
    assert "test_agent_commands_are_handled_and_polled" in stacks  # every thread's stack, ours included
    main = stacks.splitlines()[0].split("main_thread=")[1]
    assert f"Current thread {main}" in stacks or f"Thread {main}" in stacks
    assert (tmp_path / "diag" / "rank2.fr").read_bytes() == trace


@pytest.mark.timeout(60)
def test_abort_exits_the_process_with_the_named_code():
    code = textwrap.dedent("""
        from trainwarden.agent.shared import telemetry_pb2 as pb
        from trainwarden.runtime.session import Session
        rt = Session(job="j", rank=0, world_size=1, client_config=None)
        rt._on_command(pb.AgentCommand(abort=pb.Abort(reason="hang detected in pg 0")))
        print("not reached")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50,
                          start_new_session=True)
    assert proc.returncode == EXIT_ABORTED
    assert "hang detected in pg 0" in proc.stderr and "not reached" not in proc.stdout


@pytest.mark.timeout(10)
def test_client_config_is_validated():
    with pytest.raises(ValueError, match="socket_path"):
        ClientConfig(socket_path="")
    with pytest.raises(ValueError, match="queue_size"):
        ClientConfig(socket_path="/x", queue_size=1)
    with pytest.raises(ValueError, match="backoff_max_s"):
        ClientConfig(socket_path="/x", backoff_max_s=0)


@pytest.mark.timeout(20)
def test_a_step_that_raised_is_not_reported_as_completed():
    rt = Session(job="j", rank=0, world_size=1, client_config=None)

    class Recorder:
        def __init__(self):
            self.items = []

        def record(self, item):
            self.items.append(item)

    rt._client = rec = Recorder()
    with rt.step(1, tokens=5):
        pass
    with pytest.raises(RuntimeError):
        with rt.step(2, tokens=5):
            raise RuntimeError("peer is gone")
    assert [item[1] for item in rec.items if item[0] == STEP_RECORD] == [1]


@pytest.mark.timeout(20)
def test_a_committed_checkpoint_travels_with_its_path(tmp_path):
    client = TelemetryClient(ClientConfig(socket_path=str(tmp_path / "absent.sock")), pb.Hello(job="j"),
                             on_command=lambda c: None)
    rt = Session(job="j", rank=0, world_size=1, client_config=None)
    rt._client = client
    rt.checkpoint_event("committed", 20, 0.0, 4096, path="/ckpt/step-00000020")
    [message] = [m for m in client._drain() if m.WhichOneof("record") == "checkpoint"]
    assert (message.checkpoint.stage, message.checkpoint.step, message.checkpoint.path) == \
        (pb.COMMITTED, 20, "/ckpt/step-00000020")


class _Recorder:
    def __init__(self):
        self.items = []

    def record(self, item):
        self.items.append(item)

    record_soon = record


@pytest.mark.timeout(20)
def test_a_checkpoint_request_for_a_step_is_answered_at_that_step_only_and_a_hold_waits_before_the_next():
    """Before a job grows every rank saves after the same step (the save is collective), then holds."""
    rt = Session(job="j", rank=1, world_size=4, client_config=None)
    rt._client = recorder = _Recorder()
    rt.hold_limit_s = 0.3
    rt._on_command(pb.AgentCommand(checkpoint_now=pb.CheckpointNow(step=7, hold=True)))
    assert rt.poll_command().argument == "7"
    assert not rt.take_checkpoint_request(5) and not rt.take_checkpoint_request(6)
    assert not rt.take_checkpoint_request()  # an older script that names no step never saves out of turn
    assert rt.take_checkpoint_request(7) and not rt.take_checkpoint_request(7)
    with rt.step(7):  # the step that was saved after is not held
        pass
    began = time.monotonic()
    with rt.step(8):  # no restart came within the hold limit: it trains on
        pass
    assert time.monotonic() - began >= 0.3
    stages = [item for item in recorder.items if item[0] == "checkpoint"]
    assert [(s[1], s[2]) for s in stages] == [(pb.HELD, 7)]
    began = time.monotonic()
    with rt.step(9):  # held once only
        pass
    assert time.monotonic() - began < 0.3


@pytest.mark.timeout(20)
def test_a_checkpoint_request_that_arrives_after_its_step_is_dropped(caplog):
    rt = Session(job="j", rank=0, world_size=2, client_config=None)
    rt._on_command(pb.AgentCommand(checkpoint_now=pb.CheckpointNow(step=3, hold=True)))
    assert not rt.take_checkpoint_request(4)
    assert "arrived after step 4" in caplog.text
    assert not rt.take_checkpoint_request(5) and rt._hold_after is None


def _training_thread_reports(client, seconds):
    """The TrainingThread messages of the flushes in `seconds` (one every 0.1 s)."""
    found = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.1)
        found += [m.training_thread for m in client._drain() if m.WhichOneof("record") == "training_thread"]
    return found


@pytest.mark.timeout(60)
def test_a_training_thread_inside_one_native_call_is_reported_still_with_its_collective_in_flight(tmp_path):
    """A thread spinning a core inside one native call that released the GIL (as a CUDA synchronize does) is still;
    the Flight Recorder's entry that never completed says how long it has waited. The agent ages a report, so it
    hears once, and again when the collective in flight changes; once the thread returns to Python, one report
    says it moves again."""
    import hashlib
    import threading

    stop = threading.Event()
    native_started, native_done = threading.Event(), threading.Event()

    def native():
        native_started.set()
        hashlib.pbkdf2_hmac("sha256", b"w", b"s", 10_000_000)  # seconds of CPU in one call, the GIL released
        native_done.set()
        while not stop.is_set():  # then Python again
            sum(i * i for i in range(50))

    thread = threading.Thread(target=native, daemon=True)
    thread.start()
    native_started.wait()
    created = time.time_ns() - 2_000_000_000
    entries = [{"record_id": 0, "thread_id": str(thread.ident), "time_created_ns": created, "state": "scheduled",
                "retired": False, "profiling_name": "nccl:all_reduce"},
               {"record_id": 1, "thread_id": "1", "time_created_ns": created - 10**10, "state": "scheduled",
                "retired": False, "profiling_name": "nccl:all_reduce"}]  # another thread's: not this one's wait
    fr = FlightRecorder(recorders={"nccl": lambda stacks: pickle.dumps({"entries": entries})})
    client = TelemetryClient(ClientConfig(socket_path=str(tmp_path / "absent.sock")), pb.Hello(job="j"),
                             on_command=lambda c: None, flight_recorder=fr, training_thread=thread.ident)
    try:
        still = _training_thread_reports(client, 1.0)
        assert not native_done.is_set(), "the native call ended too soon for this machine: make it longer"
        assert len(still) == 1 and still[0].still_seconds >= 0.5, still  # once, not every flush
        assert 2.0 <= still[0].collective_pending_seconds < 10.0
        entries[0] = dict(entries[0], record_id=2, time_created_ns=time.time_ns())  # completed; a new one waits
        entries.append(dict(entries[0], record_id=0, state="completed"))
        again = _training_thread_reports(client, 0.3)
        assert len(again) == 1 and again[0].collective_pending_seconds < 1.0, again
        assert native_done.wait(60)
        after = _training_thread_reports(client, 1.0)
        # a tight Python loop can later look still again (the sample is biased to where it hands over the GIL)
        assert after and after[0] == pb.TrainingThread(), after
    finally:
        stop.set()
        thread.join(10)

def _still_thread_client(tmp_path, work, entries=()):
    """A client watching a thread that runs ``work(stop)``, its Flight Recorder a fake that counts its dumps."""
    import threading

    stop = threading.Event()
    thread = threading.Thread(target=work, args=(stop,), daemon=True)
    thread.start()
    dumps = []

    def dump(stacks):
        dumps.append(time.monotonic())
        return pickle.dumps({"entries": list(entries)})

    client = TelemetryClient(ClientConfig(socket_path=str(tmp_path / "absent.sock")), pb.Hello(job="j"),
                             on_command=lambda c: None, flight_recorder=FlightRecorder(recorders={"gloo": dump}),
                             training_thread=thread.ident)
    return client, dumps, stop, thread


@pytest.mark.timeout(60)
def test_a_thread_that_makes_steps_between_flushes_costs_no_flight_recorder_dump(tmp_path):
    """A CPU step's matmuls are short native calls from one line: sampled when the sender gets the GIL, the
    thread's frame looks the same at every flush. A step that ended since the last flush says it moves, so the
    still check dumps nothing (issue 48: such dumps, each of the whole ring with the GIL held, cost a busy job's
    flushes more than the periodic reads)."""
    import hashlib

    client = None

    def steps(stop):
        index = 0
        while not stop.is_set():
            for _ in range(20):
                hashlib.pbkdf2_hmac("sha256", b"w", b"s", 2_000)  # native, the GIL released, one line
            index += 1
            if client is not None:
                client.record((STEP_RECORD, index, time.time_ns(), 1_000_000, 1, None))

    client, dumps, stop, thread = _still_thread_client(tmp_path, steps)
    try:
        reports = []
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            time.sleep(0.1)
            reports += [m for m in client._drain() if m.WhichOneof("record") == "training_thread"]
        still_dumps = len(dumps) - client.fr_reads  # the periodic reads aside
        assert still_dumps == 0 and not reports, (still_dumps, reports)
    finally:
        stop.set()
        thread.join(10)


@pytest.mark.timeout(60)
def test_a_still_thread_with_no_collective_in_flight_is_dumped_for_once_per_refresh(tmp_path):
    """Inside one native call with no collective of its own in flight, the thread enqueues nothing new: after
    the dump that found none, the next comes no sooner than STILL_REFRESH_S later (the agent hears it is still
    once); a collective in flight is looked at every flush (the test above this one's neighbour)."""
    import hashlib

    from trainwarden.runtime.agent_client import STILL_REFRESH_S

    def native(stop):
        hashlib.pbkdf2_hmac("sha256", b"w", b"s", 10_000_000)  # seconds in one call, the GIL released

    done = [{"record_id": 0, "thread_id": "1", "time_created_ns": time.time_ns(), "state": "scheduled",
             "retired": True, "profiling_name": "gloo:all_reduce"}]
    client, dumps, stop, thread = _still_thread_client(tmp_path, native, done)
    try:
        reports = _training_thread_reports(client, 1.5)
        assert thread.is_alive(), "the native call ended too soon for this machine: make it longer"
        assert len(reports) == 1 and reports[0].still_seconds >= 0.5 and not reports[0].collective_pending_seconds
        assert len(dumps) - client.fr_reads == 1, dumps  # the periodic reads aside
        assert 1.5 < STILL_REFRESH_S
    finally:
        stop.set()
        thread.join(60)

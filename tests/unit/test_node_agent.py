import signal
import subprocess
import sys

import pytest

from trainwarden.agent.node.actions import AgentActions

pytestmark = pytest.mark.timeout(30)


class FakeServer:
    def __init__(self):
        self.sent = []

    def send_command(self, job, rank, command):
        self.sent.append((job, rank, command.WhichOneof("command")))
        return True


class FakeSnapshotRank:
    """A rank as the telemetry server would list it: its pid verified by the kernel unless `verified=False`."""

    def __init__(self, rank, pid, verified=True):
        import psutil

        self.rank, self.pid, self.verified = rank, pid, verified
        try:
            self.started = psutil.Process(pid).create_time()
        except psutil.Error:
            self.started = 0.0


class FakeJobState:
    def __init__(self, pids, verified=True):
        self.pids, self.verified = pids, verified

    def snapshot(self, job=None):
        class Snap:
            ranks = [FakeSnapshotRank(r, p, self.verified) for r, p in self.pids.items()]
        return (Snap(),)


def test_abort_sends_the_command_then_kills_a_rank_that_cannot_obey(procs, tmp_path):
    stopped = procs.spawn([sys.executable, "-c", "import time; time.sleep(60)"], log=tmp_path / "w.log")
    stopped.send_signal(signal.SIGSTOP)  # a SIGSTOPped worker cannot act on the abort command
    server, kills = FakeServer(), []
    actions = AgentActions(server, FakeJobState({0: stopped.pid, 1: 999999999}), incidents=None,
                           kill=lambda pid, sig: kills.append((pid, sig)), sleep=lambda s: None)
    assert actions.abort("j", [0, 1], "hang")
    assert server.sent == [("j", 0, "abort"), ("j", 1, "abort")]
    assert kills == [(stopped.pid, signal.SIGKILL)]  # the vanished pid is left alone
    assert actions.killed_by_agent(stopped.pid) and not actions.killed_by_agent(4242)


def test_a_killed_warm_worker_counts_as_killed_under_the_pid_torchrun_knows_it_by(procs, tmp_path):
    """torch's agent reports a warm worker's failure under its client's pid (runtime/zygote.py): the abort's
    SIGKILL must read as the agent's under that pid too, or the hang is recorded as a crash."""
    stopped = procs.spawn([sys.executable, "-c", "import time; time.sleep(60)"], log=tmp_path / "w.log")
    stopped.send_signal(signal.SIGSTOP)
    actions = AgentActions(FakeServer(), FakeJobState({0: stopped.pid}), incidents=None,
                           kill=lambda pid, sig: None, sleep=lambda s: None)
    actions.stand_in = lambda pid: 4242 if pid == stopped.pid else None
    assert actions.abort("j", [0], "hang")
    assert actions.killed_by_agent(stopped.pid) and actions.killed_by_agent(4242)


def test_abort_kills_the_stopped_worker_itself_and_nothing_that_exited(procs, tmp_path):
    stopped = procs.spawn([sys.executable, "-c", "import time; time.sleep(60)"], log=tmp_path / "w.log")
    stopped.send_signal(signal.SIGSTOP)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()   # exited before the abort: its pid may be anyone's by now
    actions = AgentActions(FakeServer(), FakeJobState({0: stopped.pid, 1: gone.pid}), incidents=None,
                           sleep=lambda s: None)
    assert actions.abort("j", [0, 1], "hang")
    assert stopped.wait(10) == -signal.SIGKILL


def test_diagnostics_request_reports_the_ranks_reached(tmp_path):
    server = FakeServer()
    actions = AgentActions(server, FakeJobState({}), incidents=None)
    assert list(actions.request_diagnostics("j", [0, 3], tmp_path)) == [0, 3]
    assert [s[2] for s in server.sent] == ["dump_diagnostics", "dump_diagnostics"]


class FakeEtcd:
    def __init__(self):
        self.puts = {}

    def put(self, key, value):
        self.puts[key] = value


def test_a_committed_checkpoint_reported_by_a_worker_is_published_to_etcd_by_the_agent(tmp_path):
    """Workers hold no etcd client: the agent publishes jobs/<job>/checkpoint when rank 0 reports a commit."""
    import json

    from trainwarden.agent.node.agent import AgentConfig, NodeAgent
    from trainwarden.agent.telemetry.job_telemetry import WorkerInfo

    from trainwarden.agent.etcd.writer import EtcdWriter

    etcd = FakeEtcd()
    writer = EtcdWriter(etcd)
    agent = NodeAgent(AgentConfig(socket_path=tmp_path / "a.sock", metrics_port=None, gpu_health=False,
                                  state_home=tmp_path), etcd=writer)
    agent.job_telemetry.connect(WorkerInfo(job="j", rank=0, pid=1))
    agent.job_telemetry.record_checkpoint("j", 0, stage="staged", step=10, seconds=0.1)  # not a commit
    agent.job_telemetry.record_checkpoint("j", 0, stage="committed", step=10, seconds=0.0, bytes_=123,
                                          path="/ckpt/step-00000010")
    assert writer.flush(5)
    writer.stop()
    published = json.loads(etcd.puts["/trainwarden/v1/jobs/j/checkpoint"])
    assert (published["step"], published["path"], published["bytes"]) == (10, "/ckpt/step-00000010", 123)
    assert list(etcd.puts) == ["/trainwarden/v1/jobs/j/checkpoint"]


def test_a_pid_a_worker_only_claims_is_never_signalled(procs, tmp_path):
    """Anyone who can reach the socket could name any process in a Hello: before, a stopped 'rank' claiming a
    victim's pid got the victim SIGKILLed by the abort that followed."""
    victim = procs.spawn([sys.executable, "-c", "import time; time.sleep(60)"], log=tmp_path / "v.log")
    victim.send_signal(signal.SIGSTOP)  # looks exactly like a rank that cannot obey
    kills = []
    actions = AgentActions(FakeServer(), FakeJobState({0: victim.pid}, verified=False), incidents=None,
                           kill=lambda pid, sig: kills.append(pid), sleep=lambda s: None)
    assert actions.abort("j", [0], "hang")
    assert kills == [] and actions.refused == {"unverified": 1}
    assert 'trainwarden_signals_refused_total{node="",reason="unverified"} 1.0' in _exposition(actions)


def test_a_reused_pid_and_a_process_outside_the_job_are_not_signalled(procs, tmp_path):
    worker = procs.spawn([sys.executable, "-c", "import time; time.sleep(60)"], log=tmp_path / "w.log")
    worker.send_signal(signal.SIGSTOP)
    kills = []
    state = FakeJobState({0: worker.pid})
    actions = AgentActions(FakeServer(), state, incidents=None, kill=lambda pid, sig: kills.append(pid),
                           sleep=lambda s: None)
    launcher = procs.spawn([sys.executable, "-c", "import time; time.sleep(60)"], log=tmp_path / "l.log")
    actions.register_launcher("j", launcher.pid)  # the worker is not its child
    actions.abort("j", [0], "hang")
    assert kills == [] and actions.refused == {"not_in_job": 1}

    class Reused(FakeJobState):
        def snapshot(self, job=None):
            (snap,) = super().snapshot(job)
            for r in snap.ranks:
                r.started -= 100.0  # verified back then, a different process now
            return (snap,)

    actions = AgentActions(FakeServer(), Reused({0: worker.pid}), incidents=None,
                           kill=lambda pid, sig: kills.append(pid), sleep=lambda s: None)
    actions.abort("j", [0], "hang")
    assert kills == [] and actions.refused == {"reused_pid": 1}


def _exposition(collector):
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def test_checkpoint_failures_and_set_asides_are_incidents_and_the_checkpoint_age_is_exported(tmp_path):
    from prometheus_client import generate_latest

    from trainwarden.agent.incidents import list_incidents
    from trainwarden.agent.node.agent import AgentConfig, NodeAgent
    from trainwarden.agent.telemetry.job_telemetry import WorkerInfo

    agent = NodeAgent(AgentConfig(socket_path=tmp_path / "a.sock", metrics_port=None, gpu_health=False,
                                  state_home=tmp_path))
    js = agent.job_telemetry
    for rank in (0, 1):
        js.connect(WorkerInfo(job="j", rank=rank, world_size=2, pid=100 + rank))
    text = generate_latest(agent.registry).decode()
    assert "trainwarden_checkpoint_age_seconds{" not in text  # nothing committed yet: no age to show
    for rank in (0, 1):  # every rank's save of step 20 failed: one incident
        js.record_checkpoint("j", rank, stage="failed", step=20, seconds=0.0, detail="OSError: No space left")
    js.record_checkpoint("j", 0, stage="set_aside", step=30, seconds=0.0, path="/c/step-00000030.corrupt",
                         detail="corrupt: truncated data file")
    js.record_checkpoint("j", 0, stage="committed", step=10, seconds=0.0, bytes_=5, path="/c/step-00000010")
    found = {i.kind.value: i for i in list_incidents(tmp_path, "j")}
    assert set(found) == {"checkpoint_failed", "checkpoint_set_aside"}
    assert "No space left" in found["checkpoint_failed"].evidence["summary"]
    assert found["checkpoint_set_aside"].evidence["path"] == "/c/step-00000030.corrupt"
    text = generate_latest(agent.registry).decode()
    assert 'trainwarden_checkpoint_failures_total{job="j",node=' in text
    assert 'trainwarden_checkpoints_set_aside_total{job="j"' in text
    age = next(line for line in text.splitlines() if line.startswith("trainwarden_checkpoint_age_seconds{"))
    assert 0 <= float(age.split()[-1]) < 60
    agent.stop()

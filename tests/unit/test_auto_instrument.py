"""Auto-instrumentation's rules alone (runtime/auto.py): who is instrumented, the step rule, the import hook, the
agent's side of it (collective progress, the step source). A real worker and agent: tests/integration/
test_auto_bootstrap.py."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from trainwarden.agent.telemetry.arrivals import Arrival
from trainwarden.agent.telemetry.job_telemetry import JobTelemetry, WorkerInfo, steps_from
from trainwarden.runtime import auto
from trainwarden.runtime.auto import OptimizerSteps, should_instrument

pytestmark = pytest.mark.timeout(30)

WORKER = {"TRAINWARDEN_AUTO_INSTRUMENT": "1", "TRAINWARDEN_AGENT_SOCKET": "/run/a.sock", "RANK": "3",
          "LOCAL_RANK": "1"}


def test_only_a_torchrun_worker_of_an_instrumented_job_is_instrumented_and_nothing_it_starts():
    assert should_instrument(WORKER, pid=10)
    assert not should_instrument({**WORKER, "TRAINWARDEN_AUTO_INSTRUMENT": "0"}, pid=10)  # turned off
    assert not should_instrument({k: v for k, v in WORKER.items() if k != "TRAINWARDEN_AGENT_SOCKET"}, pid=10)
    assert not should_instrument({k: v for k, v in WORKER.items() if k != "RANK"}, pid=10)  # torchrun itself
    assert not should_instrument({**WORKER, "TRAINWARDEN_AUTO_PID": "9"}, pid=10)  # a child of worker 9
    assert should_instrument({**WORKER, "TRAINWARDEN_AUTO_PID": "10"}, pid=10)  # itself, armed twice


class FakeClient:
    def __init__(self):
        self.records = []

    def record(self, item):
        self.records.append(item)


class FakeSession:
    """Session's step interface without CUDA: no event token, the record goes to the client at once."""

    def __init__(self):
        self._client = FakeClient()
        self._manual_steps = False

    def _gpu_begin(self):
        return None

    def _emit_step(self, record, token):
        self._client.record(record)


class Ticks:
    def __init__(self):
        self.t = 0

    def __call__(self):
        self.t += 1_000_000
        return self.t


def _steps() -> OptimizerSteps:
    steps = OptimizerSteps(tokens=64, clock_ns=Ticks(), wall_ns=Ticks())
    steps.session = FakeSession()
    return steps


def _sgd():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


def test_the_optimizer_that_steps_first_gives_the_steps_and_the_others_are_not_counted():
    steps = _steps()
    first, second = _sgd(), _sgd()
    for _ in range(3):
        steps.on_optimizer_step(first)
        steps.on_optimizer_step(second)
    records = steps.session._client.records
    assert [r[1] for r in records] == [0, 1, 2] and all(r[0] == auto.STEP_RECORD and r[4] == 64 for r in records)
    assert all(r[3] == 1_000_000 for r in records[1:])  # from the end of the previous step


def test_when_the_primary_optimizer_is_gone_the_next_to_step_takes_over():
    steps = _steps()
    first = _sgd()
    steps.on_optimizer_step(first)
    del first
    import gc

    gc.collect()
    steps.on_optimizer_step(_sgd())
    assert len(steps.session._client.records) == 2


def test_the_index_is_the_optimizers_own_count_when_it_keeps_one_on_the_cpu(monkeypatch):
    monkeypatch.setattr(auto, "_Tensor", torch.Tensor)  # what arming sets once torch is imported
    steps = _steps()
    p = torch.nn.Parameter(torch.ones(2))
    adam = torch.optim.Adam([p], lr=0.1)
    adam.state[p]["step"] = torch.tensor(41.0)  # resumed from the script's own checkpoint
    steps.on_optimizer_step(adam)
    assert steps.session._client.records[-1][1] == 40

    class Subclass(torch.Tensor):  # a DTensor-like wrapper: its value is never read on the step's path
        pass

    adam.state[p]["step"] = torch.tensor(41.0).as_subclass(Subclass)
    steps.on_optimizer_step(adam)
    assert steps.session._client.records[-1][1] == 1  # the boundaries counted instead


def test_rt_step_wins_and_a_broken_client_never_raises_into_the_step():
    steps = _steps()
    opt = _sgd()
    steps.session._manual_steps = True
    steps.on_optimizer_step(opt)
    assert steps.session._client.records == [] and steps.boundaries == 1

    class Broken:
        def record(self, item):
            raise RuntimeError("gone")

    steps.session._manual_steps = False
    steps.session._client = Broken()
    steps.on_optimizer_step(opt)  # no exception


def test_before_the_process_group_exists_boundaries_are_counted_but_nothing_is_sent():
    steps = OptimizerSteps()
    steps.on_optimizer_step(_sgd())
    assert steps.boundaries == 1 and steps.session is None


def test_the_import_hook_runs_after_the_module_body_then_steps_aside(tmp_path, monkeypatch):
    (tmp_path / "tw_fake_library.py").write_text(textwrap.dedent("""
        VALUE = 42
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    hook = auto._AfterImport("tw_fake_library", lambda module: seen.append(module.VALUE))
    sys.meta_path.insert(0, hook)
    try:
        import tw_fake_library  # noqa: F401

        assert seen == [42] and hook not in sys.meta_path
    finally:
        sys.modules.pop("tw_fake_library", None)
        if hook in sys.meta_path:
            sys.meta_path.remove(hook)


def test_a_failing_callback_is_one_warning_and_the_import_still_succeeds(tmp_path, monkeypatch, capsys):
    (tmp_path / "tw_fake_library2.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def broken(module):
        raise RuntimeError("no")

    sys.meta_path.insert(0, auto._AfterImport("tw_fake_library2", broken))
    try:
        import tw_fake_library2

        assert tw_fake_library2.VALUE == 1
        assert "could not instrument this worker (RuntimeError: no)" in capsys.readouterr().err
    finally:
        sys.modules.pop("tw_fake_library2", None)


def test_a_bad_tokens_per_step_is_one_warning_and_steps_per_second(capsys):
    assert auto._tokens_per_step({"TRAINWARDEN_TOKENS_PER_STEP": "lots"}) == 0
    assert "is not a whole number of tokens" in capsys.readouterr().err
    assert auto._tokens_per_step({"TRAINWARDEN_TOKENS_PER_STEP": "2048"}) == 2048


# ---- the agent's side ---------------------------------------------------------------------------------


def _connect(js, rank=0, pid=100, source="optimizer hooks"):
    js.connect(WorkerInfo(job="j", rank=rank, world_size=2, pid=pid, step_source=source))


def test_arrivals_count_as_collective_progress_and_their_gaps_are_kept_within_unbroken_stretches():
    js = JobTelemetry()
    _connect(js)
    ms = 1_000_000
    js.record_arrivals("j", 0, [Arrival("g", i, 1000 * ms + i * 100 * ms, "all_reduce") for i in range(5)],
                       continues=False)
    r = js.snapshot("j")[0].ranks[0]
    assert r.collectives_seen == 5 and r.collective_gap_max_seconds == pytest.approx(0.1)
    assert r.last_collective_unix == pytest.approx(1.4)
    # the ring lost entries between reads: the gap across them is not a gap between consecutive collectives
    js.record_arrivals("j", 0, [Arrival("g", 50, 9000 * ms, "all_reduce"), Arrival("g", 51, 9300 * ms)],
                       continues=False)
    r = js.snapshot("j")[0].ranks[0]
    assert r.collectives_seen == 7 and r.collective_gap_max_seconds == pytest.approx(0.3)
    js.record_arrivals("j", 0, [Arrival("g", 52, 9800 * ms)], continues=True)  # unbroken: counted
    assert js.snapshot("j")[0].ranks[0].collective_gap_max_seconds == pytest.approx(0.5)


def test_a_later_hello_updates_the_mesh_and_the_step_source_of_that_worker_only():
    js = JobTelemetry()
    _connect(js)
    js.update_worker("j", 0, 999, mesh={"dp": 2}, step_source="rt.step")  # another pid: ignored
    assert js.snapshot("j")[0].mesh == {} and js.snapshot("j")[0].ranks[0].step_source == "optimizer hooks"
    js.update_worker("j", 0, 100, mesh={"dp": 2}, step_source="rt.step")
    snap = js.snapshot("j")[0]
    assert snap.mesh == {"dp": 2} and snap.ranks[0].step_source == "rt.step"


def test_steps_from_says_where_the_steps_came_from():
    js = JobTelemetry()
    _connect(js, 0)
    _connect(js, 1, pid=101)
    assert steps_from(js.snapshot("j")[0].ranks) == ""
    js.record_arrivals("j", 0, [Arrival("g", 1, 10)], continues=False)
    assert steps_from(js.snapshot("j")[0].ranks) == "collectives only"
    js.record_step("j", 1, index=0, start_unix=1.0, duration_seconds=0.1)
    assert steps_from(js.snapshot("j")[0].ranks) == "optimizer hooks"


# ---- plain torchrun: `trainwarden env` -------------------------------------------------------------------


def test_trainwarden_env_keeps_the_users_path_and_flight_recorder_settings():
    from trainwarden.agent.cli.env import torchrun_environment
    from trainwarden.agent.launch.torchrun import worker_bootstrap_dir

    env = torchrun_environment(job="j", socket="/run/a.sock", tokens_per_step=8,
                               current={"PYTHONPATH": "/mine", "TORCH_FR_BUFFER_SIZE": "4096"})
    assert env["PYTHONPATH"] == f"{worker_bootstrap_dir()}:/mine"
    assert "TORCH_FR_BUFFER_SIZE" not in env and env["TORCH_NCCL_ENABLE_TIMING"] == "1"
    assert (env["TRAINWARDEN_JOB"], env["TRAINWARDEN_AGENT_SOCKET"], env["TRAINWARDEN_AUTO_INSTRUMENT"],
            env["TRAINWARDEN_TOKENS_PER_STEP"]) == ("j", "/run/a.sock", "1", "8")


def test_trainwarden_env_prints_export_lines_and_refuses_a_bad_job_name(tmp_path, capsys):
    from trainwarden.agent.cli.main import main

    sock = tmp_path / "a.sock"
    sock.touch()
    assert main(["env", "--job", "my-job", "--socket", str(sock)]) == 0
    out = capsys.readouterr().out
    assert f"export TRAINWARDEN_AGENT_SOCKET={sock}\n" in out and "export TRAINWARDEN_JOB=my-job\n" in out
    with pytest.raises(SystemExit) as exited:
        main(["env", "--job", "bad name!", "--socket", str(sock)])
    assert exited.value.code == 2
    assert main(["env", "--job", "j", "--socket", str(sock), "--tokens-per-step", "-3"]) == 2
    assert "--tokens-per-step must be 0 or more" in capsys.readouterr().err


def test_the_step_dcp_takes_to_create_an_optimizers_state_is_not_a_step(monkeypatch):
    import torch.distributed.checkpoint.state_dict as dcp_state_dict
    from torch.optim.optimizer import register_optimizer_step_post_hook

    monkeypatch.setattr(dcp_state_dict, "_init_optim_state", dcp_state_dict._init_optim_state)  # restored after
    steps = _steps()
    auto._wrap_optimizer_state_init(dcp_state_dict, steps)
    handle = register_optimizer_step_post_hook(steps.on_optimizer_step)
    try:
        model = torch.nn.Linear(2, 2)
        adam = torch.optim.Adam(model.parameters(), lr=0.1)
        dcp_state_dict.get_state_dict(model, adam)  # a restore's first move: adam.step() with zero grads, lr 0
        assert adam.state and steps.boundaries == 0 and steps.session._client.records == []
        model(torch.ones(1, 2)).sum().backward()
        adam.step()
        assert steps.boundaries == 1 and len(steps.session._client.records) == 1
    finally:
        handle.remove()


def test_on_cuda_each_optimizer_boundary_ends_the_gpu_step_the_previous_one_began():
    steps = _steps()
    tokens = iter(["events 1", "events 2", "events 3"])
    emitted = []
    steps.session._gpu_begin = lambda: next(tokens)
    steps.session._emit_step = lambda record, token: emitted.append((record[1], token))
    sgd = _sgd()
    for _ in range(3):
        steps.on_optimizer_step(sgd)
    # the first step began before CUDA timing could: it keeps its CPU time (no token)
    assert emitted == [(0, None), (1, "events 1"), (2, "events 2")]

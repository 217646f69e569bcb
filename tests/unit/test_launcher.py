from pathlib import Path

import pytest

from trainwarden.agent.launch.torchrun import LaunchSpec, parse_nnodes, torchrun_command, worker_environment

pytestmark = pytest.mark.timeout(30)


def spec(**kw):
    base = dict(job="demo", script=["-m", "trainwarden.runtime.examples.gpt", "--steps", "3"],
                rdzv_endpoint="127.0.0.1:2379", state_dir=Path("/tmp/state"), nproc_per_node=8)
    base.update(kw)
    return LaunchSpec(**base)


def test_command_uses_etcd3_rendezvous_and_module():
    cmd = torchrun_command(spec(rdzv_conf={"join_timeout": "60"}), python="python")
    assert cmd[:3] == ["python", "-m", "trainwarden.agent.launch.elastic"]  # torchrun, reporting events
    joined = " ".join(cmd)
    assert "--rdzv-backend etcd3" in joined
    assert "--rdzv-endpoint 127.0.0.1:2379" in joined
    assert "--rdzv-id demo" in joined
    assert "--rdzv-conf join_timeout=60" in joined
    assert "--log-dir /tmp/state/logs/torchelastic" in joined  # not a torchelastic_* directory in TMPDIR
    assert cmd[-4:] == ["-m", "trainwarden.runtime.examples.gpt", "--steps", "3"]


def test_environment_for_workers():
    env = worker_environment(spec(agent_socket="/run/tw.sock", extra_env={"X": "1"}), base={"PATH": "/bin"})
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env["TRAINWARDEN_JOB"] == "demo"
    assert env["TRAINWARDEN_STATE_DIR"] == "/tmp/state"
    assert env["TRAINWARDEN_CHECKPOINT_DIR"] == "/tmp/state/checkpoints"
    assert env["TRAINWARDEN_AGENT_SOCKET"] == "/run/tw.sock"
    assert env["TORCH_FR_BUFFER_SIZE"]
    assert env["X"] == "1" and env["PATH"] == "/bin"


def test_user_flight_recorder_settings_win():
    env = worker_environment(spec(), base={"TORCH_FR_BUFFER_SIZE": "5"})
    assert env["TORCH_FR_BUFFER_SIZE"] == "5"


@pytest.mark.parametrize("value, expected", [("1", (1, 1)), ("2:4", (2, 4))])
def test_parse_nnodes(value, expected):
    assert parse_nnodes(value) == expected


@pytest.mark.parametrize("kw, words", [
    ({"nnodes": "4:2"}, "1 <= MIN <= MAX"),
    ({"nnodes": "a"}, "expected N or MIN:MAX"),
    ({"job": "Demo!"}, "job name 'Demo!' is invalid"),
    ({"script": []}, "nothing to run"),
    ({"nproc_per_node": 0}, "--nproc-per-node must be at least 1, got 0"),
    ({"max_restarts": -1}, "--max-restarts must be 0 or more, got -1"),
])
def test_bad_launch_specs(kw, words):
    with pytest.raises(ValueError) as err:
        spec(**kw)
    assert words in str(err.value)


def test_a_job_of_several_nodes_needs_an_etcd_they_all_reach():
    from trainwarden.agent.launch.run import RunOptions

    with pytest.raises(ValueError, match="needs an etcd they all reach; pass --etcd"):
        RunOptions(script=["t.py"], job="j", nnodes="2:3")
    RunOptions(script=["t.py"], job="j", nnodes="2:3", etcd="10.0.0.1:2379", node="gpu-node-7.dc1")


@pytest.mark.parametrize("node", ["", "-a", "a b", "n/1", "x" * 254])
def test_node_names_that_cannot_be_keys_or_labels_are_refused(node):
    from trainwarden.agent.launch.run import RunOptions

    with pytest.raises(ValueError, match="node name"):
        RunOptions(script=["t.py"], job="j", node=node)


def test_multi_node_jobs_get_rendezvous_timings_that_recover_in_seconds():
    from trainwarden.agent.launch.run import MULTI_NODE_RDZV

    expiry = int(MULTI_NODE_RDZV["keep_alive_interval"]) * int(MULTI_NODE_RDZV["keep_alive_max_attempt"])
    assert expiry + int(MULTI_NODE_RDZV["last_call_timeout"]) <= 10  # torch's defaults: 15 + 30 s


@pytest.mark.timeout(20)
def test_the_launchers_reply_channel_waits_for_go_and_gives_up_on_timeout_or_eof():
    import os
    import threading

    from trainwarden.agent.launch.elastic import ReplyChannel

    read, write = os.pipe()
    channel = ReplyChannel(read)
    assert not channel.wait_for("go", 0.2)  # nothing said: the restart goes ahead after the wait
    threading.Timer(0.2, lambda: os.write(write, b"noise\ng")).start()
    threading.Timer(0.4, lambda: os.write(write, b"o\n")).start()
    assert channel.wait_for("go", 5.0)  # a line split over two writes still counts
    os.close(write)
    assert not channel.wait_for("go", 5.0)  # the supervisor died: no reason to wait on
    os.close(read)


def test_warm_workers_are_asked_for_by_the_launchers_own_option():
    """The zygote starts because the command says so (``--warm-zygote``), not because torchrun's script is named
    like the zygote's module."""
    from trainwarden.agent.launch.elastic import WARM_ZYGOTE_FLAG, own_options
    from trainwarden.agent.shared.contract import ZYGOTE_MODULE

    warm = torchrun_command(spec(warm_dir="/tmp/tw-warm-x"), python="python")
    assert warm[3] == WARM_ZYGOTE_FLAG
    assert warm[-6:] == ["-m", ZYGOTE_MODULE, "-m", "trainwarden.runtime.examples.gpt", "--steps", "3"]
    assert own_options(warm[3:]) == (True, warm[4:])
    cold = torchrun_command(spec(), python="python")
    assert WARM_ZYGOTE_FLAG not in cold
    named_alike = ["--standalone", "-m", ZYGOTE_MODULE, "train.py"]  # a script named like it, no option: cold
    assert own_options(named_alike) == (False, named_alike)


def test_the_warm_option_without_its_environment_says_what_is_missing(monkeypatch):
    from trainwarden.agent.launch import elastic
    from trainwarden.agent.shared.contract import WARM_SOCKET_ENV, ZYGOTE_MODULE

    monkeypatch.delenv(WARM_SOCKET_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_:
        elastic._start_zygote(["--standalone", "-m", ZYGOTE_MODULE, "train.py"])
    assert WARM_SOCKET_ENV in str(exit_.value) and "--warm-workers" in str(exit_.value)

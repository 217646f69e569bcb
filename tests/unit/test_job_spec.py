"""Job specs (`trainwarden submit JOB.toml`) and the daemon's settings (`trainwarden agent --config`): every
problem names the file and the field, and nothing half-valid gets through."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from trainwarden.agent.cli.agent import resolve_settings
from trainwarden.agent.cli.main import build_parser
from trainwarden.agent.common.job_spec import JobSpec, JobSpecError, load_job_spec, parse_job_spec

pytestmark = pytest.mark.timeout(60)

GOOD = {"name": "gpt-small", "command": ["-m", "trainwarden.runtime.examples.gpt", "--steps", "10"],
        "nnodes": "2:4", "nproc_per_node": 8, "checkpoint_dir": "/shared/ckpt", "max_restarts": 2,
        "straggler_policy": "exclude", "nodes": ["gpu-a1", "gpu-a2"], "env": {"OMP_NUM_THREADS": "4"},
        "warm_workers": False, "memory_snapshots": False, "auto_resume": False, "auto_instrument": False,
        "tokens_per_step": 4096,
        "user": "alice", "model_params": 1.3e9, "peak_tflops": 989}


def test_a_full_spec_round_trips_and_becomes_launcher_arguments(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in GOOD.items() if k != "env")
                    + '\n[env]\nOMP_NUM_THREADS = "4"\n')
    spec = load_job_spec(path)
    assert spec == parse_job_spec(GOOD, "x") == JobSpec.from_json(spec.to_json())
    assert spec.targets("gpu-a2") and not spec.targets("gpu-b1")
    args = spec.launcher_args()
    assert args[:4] == ["--job", "gpt-small", "--nnodes", "2:4"]
    assert "OMP_NUM_THREADS=4" in args and "TRAINWARDEN_CHECKPOINT_DIR=/shared/ckpt" in args
    assert args[args.index("--") + 1:] == GOOD["command"]
    assert "--cold-workers" in args and "--no-memory-snapshots" in args and not spec.auto_resume
    assert spec.user == "alice" and "alice" not in args  # the daemon's to apply (agent/node/job_user.py)
    assert parse_job_spec({**GOOD, "user": 1000}, "x").user == 1000
    assert "--no-auto-instrument" in args and args[args.index("--tokens-per-step") + 1] == "4096"
    assert args[args.index("--model-params") + 1] == "1300000000.0" and args[args.index("--peak-tflops") + 1] == "989.0"
    assert "--flops-per-step" not in args
    assert "--rendezvous-round" not in args  # native, the default
    dynamic = parse_job_spec({**GOOD, "rendezvous_round": "dynamic"}, "x").launcher_args()
    assert dynamic[dynamic.index("--rendezvous-round") + 1] == "dynamic"
    with pytest.raises(JobSpecError, match="rendezvous_round.*native, dynamic, got 'etcd'"):
        parse_job_spec({**GOOD, "rendezvous_round": "etcd"}, "x")
    stop = parse_job_spec({**GOOD, "numeric_policy": "stop"}, "x").launcher_args()
    assert stop[stop.index("--numeric-policy") + 1] == "stop" and "--numeric-policy" not in args  # rollback: the default
    with pytest.raises(JobSpecError, match="numeric_policy.*rollback, stop, alert, got 'skip'"):
        parse_job_spec({**GOOD, "numeric_policy": "skip"}, "x")
    minimal = parse_job_spec({"name": "j", "command": ["train.py"]}, "x")
    assert (minimal.nnodes, minimal.nproc_per_node, minimal.nodes, minimal.max_restarts) == ("1", 1, (), 3)
    assert minimal.auto_resume and minimal.warm_workers  # warm restarts by default (issue 26)
    assert "--cold-workers" not in minimal.launcher_args()
    assert minimal.auto_instrument and minimal.tokens_per_step == 0
    assert "--no-auto-instrument" not in minimal.launcher_args() and "--tokens-per-step" not in minimal.launcher_args()
    assert minimal.targets("anything")


@pytest.mark.parametrize("change, message", [
    ({"tokens_per_step": -1}, "field 'tokens_per_step' must be 0 or more"),
    ({"model_params": -1}, "field 'model_params' must be a finite number of 0 or more"),
    ({"peak_tflops": "989"}, "field 'peak_tflops' must be a number, got str"),
    ({"flops_per_step": 1e18, "model_params": 1e9}, "'flops_per_step' both say what a step costs"),
    ({"auto_instrument": "yes"}, "field 'auto_instrument' must be true or false"),
    ({"nproc_per_node": "8"}, "field 'nproc_per_node' must be a whole number, got str '8'"),
    ({"nproc_per_node": 0}, "field 'nproc_per_node' must be at least 1"),
    ({"nproc_per_node": True}, "field 'nproc_per_node' must be a whole number"),
    ({"comand": ["x"]}, "unknown field 'comand' (did you mean 'command'?)"),
    ({"command": []}, "field 'command' must be a non-empty list"),
    ({"command": ["-m"]}, "names no module"),
    ({"command": "train.py"}, "field 'command' must be a list"),
    ({"nnodes": "4:2"}, "field 'nnodes'"),
    ({"name": "has space"}, "field 'name' is not a job name"),
    ({"straggler_policy": "kill"}, "must be one of alert, exclude"),
    ({"max_restarts": -1}, "field 'max_restarts' must be 0 or more"),
    ({"nodes": ["ok", "bad/name"]}, "field 'nodes' entry 'bad/name' is not a node name"),
    ({"env": {"A": 1}}, "field 'env' entry 'A' must map a variable name"),
    ({"checkpoint_dir": ""}, "field 'checkpoint_dir' is empty"),
    ({"auto_resume": "yes"}, "field 'auto_resume' must be true or false, got str 'yes'"),
    ({"warm_workers": 1}, "field 'warm_workers' must be true or false, got int 1"),
    ({"user": -1}, "field 'user' must be a user name or a uid of 0 or more"),
    ({"user": "al ice"}, "field 'user' 'al ice' is not a user name"),
    ({"user": ""}, "field 'user' '' is not a user name"),
    ({"user": 1.5}, "field 'user' must be a string"),
])
def test_each_bad_field_is_named_with_the_file(change, message):
    with pytest.raises(JobSpecError) as info:
        parse_job_spec({**GOOD, **change}, "jobs/gpt.toml")
    assert str(info.value).startswith("jobs/gpt.toml: ") and message in str(info.value)


def test_missing_fields_unreadable_files_and_broken_toml(tmp_path):
    with pytest.raises(JobSpecError, match="field 'command' is missing"):
        parse_job_spec({"name": "j"}, "x")
    with pytest.raises(JobSpecError, match="no such job spec file"):
        load_job_spec(tmp_path / "absent.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text('name = "j"\ncommand = ["a"\n')
    with pytest.raises(JobSpecError, match=r"broken.toml: not valid TOML"):
        load_job_spec(broken)


def test_submit_check_validates_without_etcd(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "j"\ncommand = ["train.py"]\nnproc_per_node = "2"\n')
    run = subprocess.run([sys.executable, "-m", "trainwarden.agent.cli", "submit", str(bad), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and f"{bad}: field 'nproc_per_node' must be a whole number" in run.stderr
    good = tmp_path / "good.toml"
    good.write_text('name = "j"\ncommand = ["train.py"]\n')
    run = subprocess.run([sys.executable, "-m", "trainwarden.agent.cli", "submit", str(good), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "job j is valid" in run.stdout


def _agent_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["agent", *argv])


def test_agent_settings_come_from_flags_then_environment_then_file_then_defaults(tmp_path):
    config = tmp_path / "agent.toml"
    config.write_text('node = "from-file"\nmetrics_port = 9500\netcd = "10.0.0.5:2379"\nrun_jobs = false\n')
    s = resolve_settings(_agent_args("--config", str(config)), environ={})
    assert (s["node"], s["metrics_port"], s["etcd"], s["run_jobs"], s["metrics_host"]) == \
        ("from-file", 9500, "10.0.0.5:2379", False, "0.0.0.0")
    s = resolve_settings(_agent_args("--config", str(config)), environ={"TRAINWARDEN_METRICS_PORT": "9600",
                                                                        "TRAINWARDEN_RUN_JOBS": "yes"})
    assert (s["metrics_port"], s["run_jobs"]) == (9600, True)
    s = resolve_settings(_agent_args("--config", str(config), "--metrics-port", "9700", "--node", "flag"),
                         environ={"TRAINWARDEN_METRICS_PORT": "9600"})
    assert (s["metrics_port"], s["node"]) == (9700, "flag")


@pytest.mark.parametrize("text, message", [
    ("metrics_prot = 1\n", "unknown key 'metrics_prot' (did you mean 'metrics_port'?)"),
    ('metrics_port = "9478"\n', "key 'metrics_port' must be a whole number"),
    ("run_jobs = 1\n", "key 'run_jobs' must be true or false"),
    ("node = \n", "not valid TOML"),
])
def test_agent_config_problems_name_the_key_and_the_file(tmp_path, text, message):
    config = tmp_path / "agent.toml"
    config.write_text(text)
    with pytest.raises(ValueError) as info:
        resolve_settings(_agent_args("--config", str(config)), environ={})
    assert str(config) in str(info.value) and message in str(info.value)


def test_agent_environment_problems_name_the_variable():
    with pytest.raises(ValueError, match="TRAINWARDEN_METRICS_PORT='x': must be a whole number"):
        resolve_settings(_agent_args(), environ={"TRAINWARDEN_METRICS_PORT": "x"})
    run = subprocess.run([sys.executable, "-m", "trainwarden.agent.cli", "agent", "--config", "/nonexistent.toml"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "/nonexistent.toml: no such agent config file" in run.stderr


def test_the_example_config_in_deploy_is_valid():
    from pathlib import Path

    example = Path(__file__).parents[2] / "deploy" / "systemd" / "agent.toml"
    s = resolve_settings(_agent_args("--config", str(example)), environ={})
    assert (s["metrics_port"], s["run_jobs"], s["straggler_policy"]) == (9478, True, "alert")


@pytest.mark.parametrize("key", ["TRAINWARDEN_AGENT_SOCKET", "TRAINWARDEN_JOB", "TRAINWARDEN_STATE_DIR",
                                 "TRAINWARDEN_CHECKPOINT_DIR", "TRAINWARDEN_AUTO_INSTRUMENT",
                                 "TRAINWARDEN_ANYTHING_NEW",
                                 "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                                 "ROLE_NAME", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "NOTIFY_SOCKET"])
def test_a_spec_may_not_set_what_trainwarden_or_torchrun_sets_for_the_job(key):
    """Issue 30: ``[env]`` reached the workers after trainwarden's own variables, so a spec could point its workers
    at another agent socket, speak as another job or rank, or notify systemd as the daemon."""
    with pytest.raises(JobSpecError) as info:
        parse_job_spec({**GOOD, "env": {"OMP_NUM_THREADS": "4", key: "x"}}, "jobs/gpt.toml")
    message = str(info.value)
    assert message.startswith("jobs/gpt.toml: field 'env' entry ") and repr(key) in message
    assert "remove it from [env]" in message


def test_the_refusal_says_where_the_setting_belongs():
    with pytest.raises(JobSpecError, match="use the field 'checkpoint_dir'"):
        parse_job_spec({**GOOD, "env": {"TRAINWARDEN_CHECKPOINT_DIR": "/x"}}, "x")
    with pytest.raises(JobSpecError, match="torchrun sets it for each worker"):
        parse_job_spec({**GOOD, "env": {"MASTER_PORT": "29500"}}, "x")


def test_the_workers_own_knobs_and_a_pythonpath_stay_allowed():
    """What the workers read but trainwarden never sets (fault injection, start-up timings, Flight Recorder
    duty, checkpoint read backoff) is the job's own business; PYTHONPATH is merged after the worker bootstrap
    (agent/launch/torchrun.py), never in its place."""
    allowed = {"TRAINWARDEN_FAULTS": "crash:rank=1,step=5", "TRAINWARDEN_TIMINGS": "/tmp/marks",
               "TRAINWARDEN_FR_MAX_DUTY": "0.01", "TRAINWARDEN_CKPT_READ_BACKOFF_S": "1,2",
               "PYTHONPATH": "/home/me/lib", "LD_LIBRARY_PATH": "/opt/cuda/lib64", "NCCL_DEBUG": "INFO"}
    assert dict(parse_job_spec({**GOOD, "env": allowed}, "x").env) == allowed


def test_the_allowed_worker_knobs_are_the_names_the_runtime_reads():
    from trainwarden.agent.common.job_spec import JOB_ENV_ALLOWED
    from trainwarden.agent.shared.fault_spec import ENV_VAR as FAULTS_ENV
    from trainwarden.runtime.checkpoint.restore_plan import READ_BACKOFF_ENV
    from trainwarden.runtime.session import FR_DUTY_ENV
    from trainwarden.runtime.examples.timings import TIMINGS_ENV

    assert JOB_ENV_ALLOWED == {FAULTS_ENV, TIMINGS_ENV, FR_DUTY_ENV, READ_BACKOFF_ENV}


@pytest.mark.parametrize("change, message", [
    ({"checkpoint_dir": "ckpt/gpt"}, "field 'checkpoint_dir' 'ckpt/gpt' is relative"),
    ({"checkpoint_dir": "./ckpt"}, "give an absolute path"),
    ({"nnodes": "3:4", "nodes": ["gpu-a1", "gpu-a2"]}, "field 'nodes' names 2 nodes but nnodes '3:4' needs at "
                                                       "least 3"),
    ({"nnodes": "2", "nodes": ["gpu-a1"]}, "field 'nodes' names 1 node but nnodes '2' needs at least 2"),
    ({"nnodes": 2, "nodes": ["gpu-a1"]}, "needs at least 2"),
    ({"nnodes": "2", "nodes": ["gpu-a1", "gpu-a1"]}, "names 1 node but"),  # one node named twice
])
def test_a_relative_checkpoint_dir_and_too_few_nodes_are_refused(change, message):
    with pytest.raises(JobSpecError) as info:
        parse_job_spec({**GOOD, **change}, "jobs/gpt.toml")
    assert str(info.value).startswith("jobs/gpt.toml: ") and message in str(info.value)


def test_enough_nodes_or_none_named_is_fine():
    assert parse_job_spec({**GOOD, "nnodes": "2:4", "nodes": ["a", "b"]}, "x").nodes == ("a", "b")
    assert parse_job_spec({**GOOD, "nnodes": "4", "nodes": []}, "x").nodes == ()  # any node


def test_unverified_telemetry_streams_are_refused_unless_the_agent_is_told_to_allow_them(tmp_path):
    assert resolve_settings(_agent_args(), environ={})["allow_unverified_streams"] is False
    assert resolve_settings(_agent_args("--allow-unverified-streams"), environ={})["allow_unverified_streams"] is True
    config = tmp_path / "agent.toml"
    config.write_text("allow_unverified_streams = true\n")
    assert resolve_settings(_agent_args("--config", str(config)), environ={})["allow_unverified_streams"] is True
    assert resolve_settings(_agent_args(), environ={"TRAINWARDEN_ALLOW_UNVERIFIED_STREAMS": "yes"})[
        "allow_unverified_streams"] is True
    config.write_text("allow_unverified_stream = true\n")
    with pytest.raises(ValueError, match="unknown key 'allow_unverified_stream' .did you mean 'allow_unverified_"):
        resolve_settings(_agent_args("--config", str(config)), environ={})


def test_hang_floor_reaches_the_launcher_and_a_floor_out_of_range_is_refused():
    assert "--hang-floor" not in parse_job_spec(GOOD, "x").launcher_args()
    args = parse_job_spec({**GOOD, "hang_floor_s": 8}, "x").launcher_args()
    assert args[args.index("--hang-floor") + 1] == "8.0"
    with pytest.raises(JobSpecError, match="hang_floor_s.*between 0.5 and 180, got 0.1"):
        parse_job_spec({**GOOD, "hang_floor_s": 0.1}, "x")
    with pytest.raises(JobSpecError, match="hang_floor_s.*must be a number"):
        parse_job_spec({**GOOD, "hang_floor_s": "5s"}, "x")

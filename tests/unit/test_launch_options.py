"""Each launch option declared once (issue 46, item 1): `trainwarden run`'s flags, ``RunOptions``, a job spec, the
launcher's flags for a spec and the agent's settings all come from ``LAUNCH_OPTIONS``, and say the same thing."""

from __future__ import annotations

import dataclasses

import pytest

from trainwarden.agent.cli.agent import SETTINGS, resolve_settings
from trainwarden.agent.cli.main import build_parser
from trainwarden.agent.common.job_spec import _FIELDS, JobSpec, JobSpecError, parse_job_spec
from trainwarden.agent.common.launch_options import HANG_FLOOR_RANGE_S, LAUNCH_OPTIONS, OPTIONS
from trainwarden.agent.launch.run import RunOptions
from trainwarden.agent.watchdog.hang import HangConfig

pytestmark = pytest.mark.timeout(60)

SPEC = {"name": "j", "command": ["train.py", "--lr", "3e-4"]}
SAMPLES = {  # per option: a value other than its default that is accepted, and one that is refused
    "nnodes": ("2:4", "4:2"),
    "nproc_per_node": (8, 0),
    "spare_nodes": (1, -1),
    "max_restarts": (0, 1001),
    "straggler_policy": ("exclude", "kill"),
    "link_policy": ("exclude", "drop"),
    "numeric_policy": ("stop", "skip"),
    "rendezvous_round": ("dynamic", "etcd"),
    "hang_floor_s": (7.5, 0.1),
    "warm_workers": (False, None),
    "memory_snapshots": (False, None),
    "auto_instrument": (False, None),
    "tokens_per_step": (4096, -1),
    "flops_per_step": (1e15, float("inf")),
    "model_params": (1.3e9, -1.0),
    "peak_tflops": (989.0, float("nan")),
}
ETCD = {"etcd": "127.0.0.1:2379"}  # a job of several nodes needs one


def _run_args(argv: list[str]):
    return build_parser().parse_args(["run", *argv])


def test_every_option_has_samples_here_and_nothing_else_does():
    assert set(SAMPLES) == set(OPTIONS)


@pytest.mark.parametrize("option", LAUNCH_OPTIONS, ids=lambda o: o.name)
def test_each_surface_has_the_option_with_its_declared_default(option):
    spec_fields = {f.name: f.default for f in dataclasses.fields(JobSpec)}
    run_fields = {f.name: f.default for f in dataclasses.fields(RunOptions)}
    assert spec_fields[option.name] == option.default and run_fields[option.name] == option.default
    assert _FIELDS[option.name] == option.spec_type
    assert getattr(_run_args(["--", "t.py"]), option.name) == option.default
    flags = {a.dest: a for a in build_parser()._subparsers._group_actions[0].choices["run"]._actions}
    assert flags[option.name].help == option.help or option.kind is bool


@pytest.mark.parametrize("option", LAUNCH_OPTIONS, ids=lambda o: o.name)
def test_a_spec_value_reaches_the_launcher_as_the_same_value(option):
    good = SAMPLES[option.name][0]
    data = {**SPEC, option.name: good}
    if option.name == "spare_nodes":
        data["nnodes"] = "2:2"
    spec = parse_job_spec(data, "job.toml")
    args = spec.launcher_args()
    parsed = _run_args(args)  # what the daemon's launcher, `trainwarden run`, reads
    for each in LAUNCH_OPTIONS:
        assert getattr(parsed, each.name) == getattr(spec, each.name), (each.name, args)
    opts = RunOptions(script=list(spec.command), job=spec.name, **ETCD,
                      **{each.name: getattr(parsed, each.name) for each in LAUNCH_OPTIONS})
    assert getattr(opts, option.name) == good
    assert parsed.script[1:] == list(spec.command)


@pytest.mark.parametrize("option", [o for o in LAUNCH_OPTIONS if o.kind is not bool], ids=lambda o: o.name)
def test_a_bad_value_is_refused_in_the_same_words_by_the_spec_and_by_the_command_line(option):
    bad = SAMPLES[option.name][1]
    with pytest.raises(JobSpecError) as from_spec:
        parse_job_spec({**SPEC, option.name: bad, **({"nnodes": "2:2"} if option.name == "spare_nodes" else {})},
                       "job.toml")
    with pytest.raises(ValueError) as from_run:
        RunOptions(script=["t.py"], job="j", **ETCD, **{option.name: bad},
                   **({"nnodes": "2:2"} if option.name == "spare_nodes" else {}))
    spec_words = str(from_spec.value).split(f"'{option.name}' ", 1)[1]
    run_words = str(from_run.value).split(f"{option.flag} ", 1)[1]
    assert spec_words == run_words, (spec_words, run_words)


def test_a_step_given_two_costs_is_refused_by_both():
    with pytest.raises(JobSpecError, match="'model_params' and 'flops_per_step' both say what a step costs"):
        parse_job_spec({**SPEC, "flops_per_step": 1e15, "model_params": 1e9}, "job.toml")
    with pytest.raises(ValueError, match="--model-params and --flops-per-step both say what a step costs"):
        RunOptions(script=["t.py"], job="j", flops_per_step=1e15, model_params=1e9)


def test_the_agent_settings_that_are_launch_options_come_from_the_declaration():
    declared = {o.setting: o for o in LAUNCH_OPTIONS if o.setting}
    assert set(declared) == {"straggler_policy", "hang_floor"}
    for key, option in declared.items():
        assert SETTINGS[key] == (option.kind, option.default)
    settings = resolve_settings(build_parser().parse_args(["agent", "--hang-floor", "7.5"]), environ={})
    assert settings["hang_floor"] == 7.5 and settings["straggler_policy"] == "alert"
    with pytest.raises(ValueError, match="setting 'hang_floor' must be seconds between 0.5 and 180, got 900"):
        resolve_settings(build_parser().parse_args(["agent"]), environ={"TRAINWARDEN_HANG_FLOOR": "900"})


def test_the_hang_floor_range_ends_at_the_watchdogs_checkpoint_allowance():
    # a floor above it would override the allowance a checkpoint's save gets (agent/watchdog/hang.py)
    assert HANG_FLOOR_RANGE_S[1] == HangConfig.checkpoint_s


def test_the_launcher_flags_leave_defaults_out_but_always_say_the_size():
    args = parse_job_spec(SPEC, "job.toml").launcher_args()
    assert args == ["--job", "j", "--nnodes", "1", "--", "train.py", "--lr", "3e-4"]

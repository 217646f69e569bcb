"""Spec robustness (issue 44, item 9): one validation refuses control characters in any string and numbers past
sane bounds, with the field named, at `submit` and when the daemon reads the record back from etcd."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trainwarden.agent.common.job_spec import BOUNDS, MAX_STRING, JobSpec, JobSpecError, parse_job_spec

BASE = {"name": "j", "command": ["train.py"]}


def test_a_nul_in_an_env_key_is_refused_at_submit_with_the_field_named(tmp_path):
    spec = tmp_path / "nul.toml"
    spec.write_text('name = "j"\ncommand = ["train.py"]\n[env]\n"A\\u0000B" = "1"\n')
    run = subprocess.run([sys.executable, "-m", "trainwarden.agent.cli", "submit", str(spec), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stdout
    assert "field 'env'" in run.stderr and "control character '\\x00'" in run.stderr, run.stderr


@pytest.mark.parametrize("change, field", [
    ({"env": {"A": "x\x00y"}}, "env"),
    ({"env": {"A": "line\nforged"}}, "env"),
    ({"command": ["train.py", "--x", "a\x1b[2J"]}, "command"),
    ({"command": ["tr\x00ain.py"]}, "command"),
    ({"checkpoint_dir": "/ckpt/\x00x"}, "checkpoint_dir"),
    ({"user": "nob\x00dy"}, "user"),
    ({"nodes": ["n0\n"]}, "nodes"),
    ({"name": "j\x00"}, "name"),
    ({"env": {"A": "x" * (MAX_STRING + 1)}}, "env"),
])
def test_control_characters_and_huge_strings_are_refused_in_every_field(change, field):
    with pytest.raises(JobSpecError, match=rf"field '{field}'"):
        parse_job_spec({**BASE, **change}, "j.toml")


@pytest.mark.parametrize("change, field, bound", [
    ({"nproc_per_node": 10**9}, "nproc_per_node", BOUNDS["nproc_per_node"]),
    ({"max_restarts": 10**9}, "max_restarts", BOUNDS["max_restarts"]),
    ({"nnodes": "1:1000000000"}, "nnodes", BOUNDS["nnodes"]),
    ({"nnodes": 10**9}, "nnodes", BOUNDS["nnodes"]),
    ({"tokens_per_step": 2**62}, "tokens_per_step", BOUNDS["tokens_per_step"]),
    ({"env": {f"K{i}": "v" for i in range(BOUNDS["env"] + 1)}}, "env", BOUNDS["env"]),
])
def test_numbers_past_their_bound_are_refused_with_the_field_and_the_bound(change, field, bound):
    with pytest.raises(JobSpecError, match=rf"field '{field}'.*{bound}"):
        parse_job_spec({**BASE, **change}, "j.toml")


def test_the_daemon_reading_the_record_back_refuses_the_same():
    record = {**BASE, "env": {"A\x00": "1"}, "managed": True}
    with pytest.raises(JobSpecError, match=r"etcd: field 'env'"):
        JobSpec.from_json(record)
    with pytest.raises(JobSpecError, match=r"field 'nproc_per_node'"):
        JobSpec.from_json({**BASE, "nproc_per_node": 10**9})


def test_values_at_the_bound_and_tabs_free_text_pass():
    spec = parse_job_spec({**BASE, "nproc_per_node": BOUNDS["nproc_per_node"], "max_restarts": BOUNDS["max_restarts"],
                           "env": {"NOTE": "ünïcode ok"}}, "j.toml")
    assert spec.nproc_per_node == BOUNDS["nproc_per_node"] and spec.env["NOTE"] == "ünïcode ok"

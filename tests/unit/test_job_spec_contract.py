"""One job-spec contract for `trainwarden submit` and the node daemon (issue 23, item 2): whatever submit
accepts, the daemon's reading of the stored record accepts too, and null for an optional field is fine
everywhere."""

from __future__ import annotations

import itertools
import json

import pytest

from trainwarden.agent.common.job_spec import JobSpec, JobSpecError, OPTIONAL_FIELDS, parse_job_spec
from trainwarden.agent.etcd.jobs import JobView, submission_record

pytestmark = pytest.mark.timeout(60)

REQUIRED = {"name": "j", "command": ["train.py", "--lr", "3e-4"]}
VALUES = {"nnodes": "1:2", "spare_nodes": 0, "nproc_per_node": 2, "checkpoint_dir": "/shared/ckpt/j", "env": {"A": "1"},
          "max_restarts": 0, "straggler_policy": "exclude", "link_policy": "exclude", "numeric_policy": "stop", "nodes": ["n0"], "warm_workers": True,
          "memory_snapshots": False, "rendezvous_round": "dynamic", "hang_floor_s": 6.5,
          "auto_instrument": False, "tokens_per_step": 4096,
          "auto_resume": False, "user": "alice", "flops_per_step": 0, "model_params": 1.3e9, "peak_tflops": 989}


def _stored(spec: JobSpec) -> JobView:
    """What the daemon reads back: the record submit writes, through JSON as etcd keeps it."""
    return JobView("j", spec=json.loads(json.dumps(submission_record(spec, by="op@host"), sort_keys=True)))


# spare_nodes > 0 needs nnodes N:N with N >= 2 (any subset of these values must stay valid): its round trip with a
# value is test_spare_nodes_round_trip_through_the_stored_record below


def test_spare_nodes_round_trip_through_the_stored_record():
    spec = parse_job_spec({**REQUIRED, "nnodes": "2:2", "spare_nodes": 3, "nodes": ["a", "b"]}, "job.toml")
    assert _stored(spec).job_spec() == spec and spec.spare_nodes == 3
    assert JobSpec.from_json(spec.to_json()) == spec


def test_every_optional_field_has_a_value_here():
    assert set(VALUES) == set(OPTIONAL_FIELDS)


@pytest.mark.parametrize("absent", [()] + [(f,) for f in sorted(VALUES)] + [tuple(sorted(VALUES))])
def test_every_spec_submit_accepts_parses_in_the_daemon_path(absent):
    data = {**REQUIRED, **{k: v for k, v in VALUES.items() if k not in absent}}
    spec = parse_job_spec(data, "job.toml")  # what `submit` and `submit --check` run
    assert _stored(spec).job_spec() == spec  # what the daemon runs on the record in etcd
    assert JobSpec.from_json(spec.to_json()) == spec


def test_every_pair_of_optional_fields_present_or_absent_round_trips():
    # every pair in its four present/absent states, the others all present or all absent: each interaction of
    # two fields is covered, and the count grows with the square of the fields (the exhaustive 2^N, 2^19 with
    # rendezvous_round, took 44 s)
    fields = sorted(VALUES)
    for a, b in itertools.combinations(fields, 2):
        for rest, keep_a, keep_b in itertools.product((False, True), repeat=3):
            keep = {f: rest for f in fields} | {a: keep_a, b: keep_b}
            data = {**REQUIRED, **{f: VALUES[f] for f in fields if keep[f]}}
            spec = parse_job_spec(data, "job.toml")
            assert _stored(spec).job_spec() == spec, data


def test_null_for_an_optional_field_is_its_default_everywhere():
    nulls = {**REQUIRED, **{f: None for f in VALUES}}
    assert parse_job_spec(nulls, "job.toml") == parse_job_spec(REQUIRED, "job.toml")
    assert JobSpec.from_json({**nulls, "managed": True}) == parse_job_spec(REQUIRED, "x")


def test_a_spec_without_checkpoint_dir_is_stored_without_a_null():
    spec = parse_job_spec(REQUIRED, "job.toml")
    assert "checkpoint_dir" not in spec.to_json()  # a daemon of the previous release reads it too


@pytest.mark.parametrize("field", ["name", "command"])
def test_a_required_field_may_not_be_null(field):
    with pytest.raises(JobSpecError, match=f"field '{field}' is missing"):
        parse_job_spec({**REQUIRED, field: None}, "job.toml")


def test_the_daemon_refuses_an_unknown_field_in_a_stored_spec_rather_than_ignoring_it():
    view = JobView("j", spec={**submission_record(parse_job_spec(REQUIRED, "x"), by="op"), "privileged": True})
    with pytest.raises(JobSpecError, match="etcd jobs/j/spec: unknown field 'privileged'"):
        view.job_spec()

"""When ``trainwarden run`` stops the job rather than restart it (agent/launch/stop_verdict.py ``StopVerdict``): the
workers' own verdicts (resume blocked, numeric stop) and a round that fails before its first step as the previous one
did; what it says and the exit code, with a fake transition."""

from __future__ import annotations

import io
import signal
import threading
from pathlib import Path

from trainwarden.agent.common import exit_codes
from trainwarden.agent.common.job_lifecycle import JobPhase
from trainwarden.agent.launch.stop_verdict import StopVerdict
from trainwarden.agent.shared.contract import EXIT_NUMERIC_STOP, EXIT_RESUME_BLOCKED


def _verdict() -> tuple[StopVerdict, io.StringIO, list]:
    out, phases = io.StringIO(), []
    verdict = StopVerdict(job="j", numeric_policy="stop", log_path=Path("/state/j/logs/run.log"), out=out)
    verdict.wake = threading.Event()
    return verdict, out, phases


def _failed(rank: int, code: int, message: str = "", pid: int = 0) -> dict:
    return {"global_rank": rank, "exitcode": code, "message": message, "pid": pid}


def test_the_same_failure_twice_before_a_first_step_is_a_configuration_error():
    verdict, out, phases = _verdict()
    failures = [_failed(0, 1, "No such file: data.bin")]
    assert not verdict.round_failed(failures, in_round=False, killed=lambda pid: False)
    assert verdict.reason is None and not verdict.wake.is_set()  # once may be a transient fault
    assert not verdict.round_failed(failures, in_round=False, killed=lambda pid: False)
    assert verdict.reason is not None and "failed the same way twice" in verdict.reason
    assert "No such file: data.bin" in verdict.reason and verdict.wake.is_set()
    assert verdict.stop(lambda *a, **k: phases.append(a)) == exit_codes.EXIT_CONFIG
    assert phases[0][0] == JobPhase.FAILED and phases[0][1].startswith("configuration error: ")


def test_failures_after_a_step_signals_and_the_agents_own_kills_are_not_a_configuration_error():
    verdict, _, _ = _verdict()
    for _ in range(2):
        verdict.round_failed([_failed(0, 1, "boom")], in_round=True, killed=lambda pid: False)
        verdict.round_failed([_failed(1, -signal.SIGTERM)], in_round=False, killed=lambda pid: False)
        verdict.round_failed([_failed(2, 1, "hung", pid=42)], in_round=False, killed=lambda pid: pid == 42)
    assert verdict.reason is None


def test_a_different_failure_the_second_time_is_not_a_configuration_error():
    verdict, _, _ = _verdict()
    verdict.round_failed([_failed(0, 1, "a")], in_round=False, killed=lambda pid: False)
    verdict.round_failed([_failed(0, 1, "b")], in_round=False, killed=lambda pid: False)
    assert verdict.reason is None


def test_workers_that_may_not_resume_stop_the_job_in_the_committing_ranks_words():
    verdict, out, phases = _verdict()
    assert verdict.round_failed([_failed(0, EXIT_RESUME_BLOCKED, "short"), _failed(1, 1)], in_round=False,
                                killed=lambda pid: False)
    verdict.checkpoint_detail("step 40: its shards do not match the metadata")
    assert verdict.reason == "short" and verdict.wake.is_set()
    assert verdict.stop(lambda *a, **k: phases.append(a)) == exit_codes.EXIT_RESUME_BLOCKED
    assert "stopped rather than start over: step 40: its shards do not match" in out.getvalue()
    assert phases == [(JobPhase.FAILED, "resume blocked: step 40: its shards do not match the metadata")]


def test_non_finite_values_stop_the_job_without_a_restart():
    verdict, out, phases = _verdict()
    assert verdict.round_failed([_failed(3, EXIT_NUMERIC_STOP)], in_round=True, killed=lambda pid: False)
    assert verdict.reason == verdict.numeric_stop == "the training computed values that are not finite"
    assert verdict.stop(lambda *a, **k: phases.append(a)) == exit_codes.EXIT_NUMERIC_STOP
    assert "(--numeric-policy stop)" in out.getvalue() and phases[0][0] == JobPhase.FAILED

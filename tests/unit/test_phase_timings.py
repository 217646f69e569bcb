"""runtime/examples/timings.py: the start-up phase marks the restart benchmark reads; off (and free) by default."""

import os

import pytest

from trainwarden.runtime.examples.timings import TIMINGS_ENV, PhaseTimings, read_marks

pytestmark = pytest.mark.timeout(30)


def test_off_without_the_variable_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    timings = PhaseTimings.from_env(rank=3, env={})
    assert not timings.enabled
    timings.mark("imported")
    timings.mark("restored", 12.5)
    assert list(tmp_path.iterdir()) == []


def test_marks_are_read_back_with_rank_round_and_pid(tmp_path):
    env = {TIMINGS_ENV: str(tmp_path / "marks"), "TORCHELASTIC_RESTART_COUNT": "1"}
    clock = iter([100.0, 101.5]).__next__
    timings = PhaseTimings(env[TIMINGS_ENV], rank=5, restart_count=1, clock=clock)
    timings.mark("imported", 99.0)
    timings.mark("pg_up")
    timings.mark("restored")
    assert PhaseTimings.from_env(rank=5, env=env).enabled
    marks = sorted(read_marks(tmp_path / "marks"), key=lambda m: m["t"])
    assert [(m["phase"], m["t"]) for m in marks] == [("imported", 99.0), ("pg_up", 100.0), ("restored", 101.5)]
    assert {(m["rank"], m["restart_count"], m["pid"]) for m in marks} == {(5, 1, os.getpid())}


def test_a_torn_line_is_skipped_and_an_unwritable_directory_disables_marks(tmp_path):
    (tmp_path / "rank0-pid1.jsonl").write_text('{"phase": "imported", "t": 1.0, "rank": 0, "pid": 1, '
                                              '"restart_count": 0}\n{"phase": "pg')
    assert [m["phase"] for m in read_marks(tmp_path)] == ["imported"]
    blocker = tmp_path / "file"
    blocker.write_text("")
    timings = PhaseTimings(blocker / "marks", rank=0)
    timings.mark("imported")  # logs once, never raises
    assert not timings.enabled

"""A job's history on disk (agent/common/job_history.py): what the launcher writes is what the report reads, a
killed run's half line is skipped and counted, the step log stays bounded, and an unwritable directory costs the
job nothing but its history."""

from __future__ import annotations

from trainwarden.agent.common.job_history import FULL_STEPS, JobHistory, kept_step, read_history


def test_what_the_launcher_writes_is_what_the_report_reads(tmp_path):
    history = JobHistory(tmp_path / "history", flush_every=3600, goodput=lambda: {"ratio": 0.5})
    assert history.start()
    history.event("launched", 100.0, node="n0")
    for rank in range(3):
        history.step(rank, 1, 101.0 + rank / 100, 0.25)
    history.event("round_failed", 102.0, failures=[{"rank": 1, "exitcode": -9}])
    history.close()
    again = JobHistory(tmp_path / "history", flush_every=3600)  # a resumed run appends
    assert again.start()
    again.step(0, 2, 110.0, 0.5)
    again.close()
    h = read_history(tmp_path / "history")
    assert h.rank == [0, 1, 2, 0] and h.step == [1, 1, 1, 2] and h.duration == [0.25, 0.25, 0.25, 0.5]
    assert [e["event"] for e in h.events] == ["launched", "round_failed"] and h.events[1]["failures"][0]["rank"] == 1
    assert h.goodput == {"ratio": 0.5} and h.skipped_lines == 0


def test_a_half_written_line_is_skipped_and_counted(tmp_path):
    d = tmp_path / "history"
    d.mkdir()
    (d / "steps.csv").write_text("rank,step,end_unix,duration_s\n0,1,5.0,0.1\n0,2,nan,0.1\n0,3,5.")
    (d / "events.jsonl").write_text('{"t": 1, "event": "launched"}\n{"t": 2, "ev')
    (d / "goodput.json").write_text("{")
    h = read_history(d)
    assert h.step == [1] and len(h.events) == 1 and h.skipped_lines == 3 and h.goodput is None
    assert read_history(tmp_path / "nothing").empty


def test_the_step_log_keeps_every_step_at_first_then_one_in_ten_then_one_in_a_hundred():
    assert all(kept_step(s) for s in range(FULL_STEPS))
    decade = [s for s in range(FULL_STEPS, 2 * FULL_STEPS) if kept_step(s)]
    assert len(decade) == FULL_STEPS // 10
    late = [s for s in range(10 * FULL_STEPS, 11 * FULL_STEPS) if kept_step(s)]
    assert len(late) == FULL_STEPS // 100


def test_an_unwritable_directory_costs_the_history_only(tmp_path):
    (tmp_path / "history").write_text("a file where the directory should be")
    history = JobHistory(tmp_path / "history")
    assert not history.start()
    history.step(0, 1, 1.0, 0.1)
    history.event("launched")
    history.close()
    assert history._steps == [] and history._events == []

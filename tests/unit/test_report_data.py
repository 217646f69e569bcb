"""`trainwarden report` on synthetic histories (agent/report/): the thinning of step times, the numbers and notes
the page shows, and the errors that say what to do."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest

from trainwarden.agent.cli.main import main
from trainwarden.agent.common import exit_codes
from trainwarden.agent.common.job_history import History, JobHistory, read_history
from trainwarden.agent.common.paths import job_state_dir
from trainwarden.agent.incidents import Incident, IncidentKind, IncidentStore
from trainwarden.agent.report import ReportError, build_report, gather
from trainwarden.agent.report.data import POINTS_PER_TRACE, downsample, step_series

pytestmark = pytest.mark.timeout(120)

T0 = 1_700_000_000.0
GOODPUT = {"wall_s": 100.0, "productive_s": 70.0, "ratio": 0.7,
           "badput_s": {"startup": 12.5, "lost_progress": 10.0, "between_steps": 7.5, "restart": 0.0}}


def write_history(home, job="j", *, ranks=2, steps=10, goodput=GOODPUT, restart_at=None):
    """A job's history as the launcher writes it (JobHistory): ``steps`` steps per rank, one round, and with
    ``restart_at`` a failed round and steps 5.. redone in a second round."""
    history = JobHistory(job_state_dir(job, home) / "history", flush_every=3600, goodput=lambda: goodput)
    history.start()
    history.event("launched", t=T0, node="n0", pid=1)
    history.event("round_started", t=T0 + 1, round=0, workers=ranks)
    t = T0 + 2
    for step in range(1, steps + 1):
        if step == restart_at:
            history.event("round_failed", t=t, failures=[{"rank": 1, "exitcode": -9, "message": ""}])
            history.event("round_started", t=t + 1, round=1, workers=ranks)
            t += 2
            for redo in range(5, step):
                for rank in range(ranks):
                    history.step(rank, redo, t, 0.5)
                t += 0.5
        for rank in range(ranks):
            history.step(rank, step, t + rank * 0.01, 0.5 + 0.1 * rank)
        t += 0.5
    history.event("ended", t=t + 1, phase="succeeded", exit_code=0)
    history.close()
    return job_state_dir(job, home)


def test_downsample_keeps_everything_that_fits_and_the_spikes_of_what_does_not():
    assert downsample(np.ones(10), 10).tolist() == list(range(10))
    values = np.full(100_000, 0.2)
    values[12_345], values[77_777] = 9.0, 0.01
    keep = downsample(values, 5_000)
    assert len(keep) <= 5_000
    assert 12_345 in keep and 77_777 in keep
    assert np.all(np.diff(keep) > 0)


def test_eight_ranks_of_a_hundred_thousand_steps_stay_within_the_budget():
    n = 100_000
    history = History(rank=[r for _ in range(n) for r in range(8)], step=[s for s in range(n) for _ in range(8)],
                      end=[T0 + s for s in range(n) for _ in range(8)], duration=[0.2] * (8 * n))
    series, per_rank = step_series(history)
    assert per_rank and len(series) == 8
    for trace in series:
        assert np.count_nonzero(~np.isnan(trace.duration)) <= POINTS_PER_TRACE


def test_a_restart_breaks_each_rank_line_and_many_ranks_show_min_median_max(tmp_path):
    write_history(tmp_path, ranks=2, steps=10, restart_at=8)
    series, per_rank = step_series(read_history(job_state_dir("j", tmp_path) / "history"))
    assert per_rank and [s.name for s in series] == ["rank 0", "rank 1"]
    assert np.count_nonzero(np.isnan(series[0].duration)) == 1  # one break: between round 0 and round 1
    steps = 4
    history = History(rank=[r for s in range(steps) for r in range(100)],
                      step=[s for s in range(steps) for _ in range(100)], end=[T0 + s for s in range(steps) for _ in range(100)],
                      duration=[float(r) for _ in range(steps) for r in range(100)])
    series, per_rank = step_series(history)
    assert not per_rank
    by_name = {s.name: s.duration.tolist() for s in series}
    assert by_name == {"min across ranks": [0.0] * steps, "median across ranks": [49.5] * steps,
                       "max across ranks": [99.0] * steps}


def test_the_page_holds_the_goodput_numbers_and_embeds_plotly(tmp_path):
    write_history(tmp_path, restart_at=8)
    page = build_report("j", tmp_path)
    assert "steps redone" in page and "between steps" in page and "lost_progress" not in page.split("<h2>Goodput")[1]
    for seconds, share in (("70.0", "70.0%"), ("12.5", "12.5%"), ("10.0", "10.0%"), ("7.5", "7.5%")):
        assert f"<td class=n>{seconds}</td><td class=n>{share}</td>" in page
    assert "70.0% of 100 s" in page  # the header's goodput
    assert "<dt>restarts</dt><dd>1</dd>" in page and "<dt>runs</dt><dd>1</dd>" in page
    assert "<dt>final phase</dt><dd>succeeded</dd>" in page
    assert not re.search(r"<script[^>]*\bsrc=", page), "plotly.js must be in the page, not loaded from a CDN"
    assert len(page) > 1_000_000 and "Plotly.newPlot" in page
    assert page.count('class="plotly-graph-div"') == 2  # the timeline and the goodput bar


def test_unreadable_lines_are_counted_on_the_page_and_on_stderr(tmp_path, capsys):
    state = write_history(tmp_path)
    with open(state / "history" / "steps.csv", "a") as f:
        f.write("0,11,not-a-time,0.5\n0,12\n")
    with open(state / "history" / "events.jsonl", "a") as f:
        f.write('{"t": "soon", "event": "launched"}\n')  # parses, but has no time: left out, not a crash
        f.write('{"t": 1, "event": "launch')
    assert gather("j", tmp_path).history.skipped_lines == 3
    out = tmp_path / "out" / "r.html"
    assert main(["report", "--job", "j", "--state-home", str(tmp_path), "--out", str(out)]) == exit_codes.EXIT_OK
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out)
    assert "3 unreadable line(s)" in captured.err
    page = out.read_text()
    assert "3 line(s) of the history could not be read" in page and "<dt>runs</dt><dd>1</dd>" in page


def test_the_default_output_is_the_jobs_state_directory(tmp_path, capsys):
    state = write_history(tmp_path)
    assert main(["report", "--job", "j", "--state-home", str(tmp_path)]) == exit_codes.EXIT_OK
    assert capsys.readouterr().out.strip() == str(state / "report.html")
    assert (state / "report.html").read_text().startswith("<!DOCTYPE html>")


def test_an_unknown_job_names_the_directory_and_what_to_do(tmp_path, capsys):
    write_history(tmp_path, job="other")
    with pytest.raises(ReportError) as err:
        gather("nope", tmp_path)
    message = str(err.value)
    assert str(tmp_path / "jobs" / "nope") in message and "other" in message
    assert "trainwarden jobs" in message and "--state-home" in message
    assert main(["report", "--job", "nope", "--state-home", str(tmp_path)]) == exit_codes.EXIT_USAGE
    assert "no state directory" in capsys.readouterr().err


def test_a_job_without_history_says_why(tmp_path, capsys):
    job_state_dir("old", tmp_path).mkdir(parents=True)
    with pytest.raises(ReportError, match="ran before trainwarden recorded"):
        gather("old", tmp_path)
    assert main(["report", "--job", "old", "--state-home", str(tmp_path)]) == exit_codes.EXIT_USAGE
    assert "never started" in capsys.readouterr().err


def test_without_plotly_the_error_says_what_to_install(tmp_path, monkeypatch):
    write_history(tmp_path)
    for name in ("plotly", "plotly.graph_objects", "plotly.subplots"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ReportError, match=r"pip install 'plotly>=5.20'"):
        build_report("j", tmp_path)


def test_incidents_and_checkpoints_are_on_the_page_escaped(tmp_path):
    state = write_history(tmp_path, restart_at=8)
    store = IncidentStore(state_dir=lambda job: job_state_dir(job, tmp_path))
    store.record(Incident(id="20231114T221325000Z-abcdef", kind=IncidentKind.CRASH, job="j", node="n0", ranks=(1,),
                          detected_at=T0 + 6, action="restart </script><b>now</b>",
                          evidence={"summary": "rank 1 (SIGKILL)"}))
    ckpts = state / "checkpoints"
    (ckpts / "step-00000005").mkdir(parents=True)
    (ckpts / "step-00000005" / "__0_0.distcp").write_bytes(b"x" * 2048)
    (ckpts / "step-00000006").mkdir()
    (ckpts / "step-00000006" / ".metadata").write_bytes(b"not a pickle")
    page = build_report("j", tmp_path)
    assert "20231114T221325000Z-abcdef" in page and "<td>crash</td>" in page
    assert "</script><b>now" not in page and "restart &lt;/script&gt;&lt;b&gt;now" in page
    tables = page.split("<h2>Checkpoints</h2>")[1]
    assert "<td class=n>5</td><td>unfinished</td><td class=n>2.0 KiB</td>" in tables
    assert "<td class=n>6</td><td>corrupt</td>" in tables


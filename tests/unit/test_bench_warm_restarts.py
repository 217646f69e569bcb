"""tests/bench/warm_restarts.py: the verdict on recorded-like runs (the job's records, the supervisor's history
events, the logs, the exit code), without running anything."""

import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from warm_restarts import judge, read_json_lines  # noqa: E402

pytestmark = pytest.mark.timeout(30)

T0 = 1_800_000_000.0


def _records(restarts: int, nproc: int = 2, *, warm: bool = True, skip: tuple = ()) -> list[dict]:
    """What crash_loop.py writes when all goes well: every round's ranks train, one crashes, the last finishes.
    ``skip``: (round, rank) pairs whose lines are missing."""
    out = []
    for r in range(restarts + 1):
        at = T0 + 10 * r
        for rank in range(nproc):
            if (r, rank) not in skip:
                out.append({"event": "step", "restart": r, "rank": rank, "warm": warm, "t": at + 1 + rank / 10})
        if r < restarts:
            out.append({"event": "crash", "restart": r, "rank": r % nproc, "warm": warm, "t": at + 2})
        else:
            out += [{"event": "finished", "restart": r, "rank": rank, "warm": warm, "t": at + 3}
                    for rank in range(nproc)]
    return out


def _failed(*codes: int) -> dict:
    return {"event": "round_failed", "failures": [{"rank": rank, "exitcode": code} for rank, code in enumerate(codes)]}


def _events(restarts: int) -> list[dict]:
    out = [{"event": "launched"}]
    for r in range(restarts):
        crashed = r % 2
        out += [_failed(*[1 if rank == crashed else -signal.SIGTERM for rank in range(2)]),
                {"event": "restarting", "reason": "failed"}]
    return out + [{"event": "ended", "phase": "succeeded"}]


def _log(restarts: int) -> str:
    return "".join(f"crash_loop: restart {r} rank 0 step 1 warm\n" for r in range(restarts + 1))


def test_a_clean_run_has_no_aborted_round_and_times_each_restart():
    verdict = judge(3, 2, _records(3), _events(3), [_log(3), ""], 0)
    assert verdict.aborted == 0 and verdict.problems == {}
    assert verdict.restart_s == [9.0, 9.0, 9.0]  # the crash (+2 s) to the next round's first step (+11 s)
    assert verdict.lines()[-1] == "warm restarts: 3 restarts, 0 aborted"
    assert verdict.lines()[0].startswith("warm restarts: crash -> first step of the next round: median 9.00 s")


def test_a_worker_killed_by_an_abort_signal_aborts_its_round_but_sigkill_and_sigterm_do_not():
    events = _events(3)
    events[3] = _failed(-signal.SIGSEGV, -signal.SIGKILL)  # the second failure: round 1's
    verdict = judge(3, 2, _records(3), events, [_log(3)], 0)
    assert verdict.problems == {1: ["rank 0 ended by SIGSEGV"]}
    assert verdict.lines()[-1] == "warm restarts: 3 restarts, 1 aborted"


def test_a_fatal_line_counts_against_the_round_that_printed_last_once_for_both_logs():
    log = ("crash_loop: restart 0 rank 0 step 1 warm\ncrash_loop: restart 1 rank 1 step 2 warm\n"
           "F1129 21:00:00.000 123 ev_epoll1_linux.cc:1121] Check failed: next_worker->state == KICKED\n"
           "crash_loop: restart 2 rank 0 step 1 warm\n")
    # `trainwarden run`'s own output repeats torchrun's lines: the same abort is one problem, of the same round
    verdict = judge(2, 2, _records(2), _events(2), [log, log], 0)
    assert list(verdict.problems) == [1] and len(verdict.problems[1]) == 1
    assert "Check failed" in verdict.problems[1][0]
    fatal = judge(2, 2, _records(2), _events(2), ["Fatal Python error: Segmentation fault\n"], 0)
    assert list(fatal.problems) == [0]


def test_a_restart_whose_workers_do_not_train_again_is_aborted_and_so_are_the_rounds_never_reached():
    records = [r for r in _records(4) if r["restart"] <= 2]
    records = [r for r in records if not (r["restart"] == 2 and r["event"] == "step" and r["rank"] == 1)]
    verdict = judge(4, 2, records, _events(2), [""], 1)
    assert verdict.problems[2][0] == "rank(s) [1] did not train a step"
    assert "trainwarden run exited with 1" in verdict.problems[2]
    assert verdict.problems[3] == ["the run never got to it"] and verdict.problems[4] == ["the run never got to it"]
    assert verdict.aborted == 3


def test_the_last_round_must_finish_and_the_run_succeed():
    records = [r for r in _records(1) if r["event"] != "finished"]
    verdict = judge(1, 2, records, _events(1) + [_failed(0, 1)], [""], -signal.SIGABRT)
    assert verdict.problems[1] == ["the last round did not finish", "the last round failed",
                                   "trainwarden run ended by SIGABRT"]
    assert judge(1, 2, _records(1), _events(1), [""], None).problems == {1: ["the run did not end in time"]}


def test_cold_workers_are_an_abort_unless_the_zygote_said_why():
    records = _records(2)
    for rec in records:
        if rec["restart"] == 2:
            rec["warm"] = False
    gone = judge(2, 2, records, _events(2), [""], 0)
    assert gone.problems == {2: ["rank(s) [0, 1] started cold without a word from the zygote: it is gone"]}
    said = judge(2, 2, records, _events(2), ["trainwarden: warm workers are off for this job from now: ...\n"], 0)
    assert said.aborted == 0 and said.cold_rounds == [2]


def test_a_round_without_its_planned_crash_is_reported():
    records = [r for r in _records(2) if not (r["event"] == "crash" and r["restart"] == 0)]
    assert judge(2, 2, records, _events(2), [""], 0).problems == {0: ["no rank crashed as planned"]}


def test_json_lines_skip_a_torn_line(tmp_path):
    path = tmp_path / "record.jsonl"
    path.write_text('{"event": "step", "restart": 0}\n{"event": "cra')
    assert read_json_lines(path) == [{"event": "step", "restart": 0}]
    assert read_json_lines(tmp_path / "missing") == []

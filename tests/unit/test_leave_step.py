"""The step a leave (a drain, an exclusion) or a grow agrees on (agent/launch/regroup.py ``Regrouping.step_ahead``):
far enough ahead that no rank has passed it when the request reaches every node, and no further, at the job's pace
now."""

from __future__ import annotations

import io
import time

from trainwarden.agent.launch.progress import JobProgress
from trainwarden.agent.launch.regroup import GROW_MARGIN_STEPS, Regrouping
from trainwarden.agent.launch.worker_round import WorkerRound


def _regrouping(progress: JobProgress, step: int, step_end: float) -> Regrouping:
    worker_round = WorkerRound(number=1, pids=(11, 12), ranks=(0, 1))
    worker_round.stepped(step, step_end)
    return Regrouping(job="j", node="n1", multi_node=True, out=io.StringIO(), worker_round=lambda: worker_round,
                      pace=progress.median_step_seconds)


def _progress(*paces: tuple[int, float]) -> tuple[JobProgress, int]:
    """Two local ranks' steps: ``count`` steps of ``seconds`` for each (count, seconds); the last step's index."""
    progress, index, now = JobProgress(), 0, time.time() - 1000
    progress.round_started(now)
    for count, seconds in paces:
        for _ in range(count):
            index, now = index + 1, now + seconds
            for pid in (11, 12):
                progress.step(index, now, seconds, worker=pid)
    return progress, index


def test_a_healthy_job_is_asked_for_three_seconds_of_steps():
    progress, last = _progress((300, 0.25))
    assert _regrouping(progress, last, time.time()).step_ahead() == last + 13  # int(3 s / 0.25 s) + 1


def test_a_job_slowed_by_the_fault_gets_its_margin_at_its_pace_now():
    """Issue 47: a degraded link made every step 5x longer; n1 is excluded and the spare waits for the agreed step.
    The margin was taken from the median of every step the run had seen (0.25 s: 13 steps, 19.5 s at the slow
    pace); it is from the recent ones (5 steps, 7.5 s)."""
    progress, last = _progress((400, 0.25), (12, 1.5))
    assert _regrouping(progress, last, time.time()).step_ahead() == last + GROW_MARGIN_STEPS


def test_a_job_at_seconds_a_step_is_asked_for_three_steps_not_five():
    """Issue 47, the bed: a degraded link made steps 9 s; the floor of 5 steps was 45 s before the spare could step
    in. Three steps still cover a request that takes a second or two to reach every node."""
    progress, last = _progress((300, 2.0), (12, 9.0))
    assert _regrouping(progress, last, time.time()).step_ahead() == last + 3


def test_the_steps_since_the_newest_report_are_counted_at_the_pace_of_the_newest_steps():
    """Issue 47, the bed (session 32): n1 was named 6 s after its newest step report, its steps just slowed from 1.2
    to 9 s by the degraded link. The 20-step median (1.2 s) credited the ranks with 5 steps finished in those 6 s,
    and the agreed step was 8 ahead: 70 s at the slow pace before the spare stepped in. At the newest steps' pace they
    finished none: 3 ahead."""
    progress, last = _progress((300, 1.2), (4, 9.0))
    assert _regrouping(progress, last, time.time() - 6.0).step_ahead() == last + 3


def test_a_job_at_its_steady_pace_is_still_credited_with_the_steps_since_its_newest_report():
    progress, last = _progress((300, 0.25))
    assert _regrouping(progress, last, time.time() - 2.0).step_ahead() == last + 8 + 13  # 2 s / 0.25 s, then 3 s

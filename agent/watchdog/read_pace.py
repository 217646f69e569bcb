"""The pace of the ranks' Flight Recorder reads (agent/watchdog/loop.py asks it every check): each read dumps the
whole ring, so while no detector (straggler, comm regression) is near a decision for ``after_s`` the workers are
asked to read at most every ``period_s`` (``WatchdogActions.set_read_pace``), and at their own pace again as soon
as one is. At the same times, a job whose every connected rank reports steps is asked to send them at most every
``send_s`` while they keep ending (runtime/send_pace.py: each batch then promises the next, and the hang detector
counts a job whose ranks all keep their promises as progressing, loop.py). Also how long a rank's collectives and
its newest step may go unreported at that pace, which the hang detector allows for: a late report counts from when
its event happened, up to that long before it arrived."""

from __future__ import annotations

import logging
from typing import Callable

from trainwarden.agent.shared.contract import FLUSH_INTERVAL_S, FR_READ_INTERVAL_S, STEPS_STOPPED_AFTER_S
from trainwarden.agent.telemetry.job_telemetry import JobSnapshot
from trainwarden.agent.watchdog.interface import WatchdogActions

__all__ = ["ReadPacer"]

log = logging.getLogger("trainwarden.agent.watchdog.loop")  # the watchdog's log, as before the split


class ReadPacer:
    """The read pace asked of each job's ranks (module docstring); ``period_s`` 0 never slows them."""

    def __init__(self, actions: WatchdogActions, *, period_s: float, after_s: float,
                 clock: Callable[[], float], send_s: float = 0.0) -> None:
        self._actions, self._period_s, self._after_s, self._clock = actions, period_s, after_s, clock
        self._send_s = send_s
        self._attended: dict[str, float] = {}  # job -> when a detector was last near a decision (or first seen)
        # job -> rank -> ((pid, stream), (read period, send period)) told
        self._paced: dict[str, dict[int, tuple[tuple[int, int], tuple[float, float]]]] = {}
        self.read_pace: dict[str, float] = {}
        """job -> the read period its workers are asked for (0: their own)."""
        self.send_pace: dict[str, float] = {}
        """job -> how long its workers are asked to hold back steps that keep ending (0: not at all)."""
        self._slow_until: dict[str, float] = {}  # job -> until when a read at the slow pace may be pending
        self._held_until: dict[str, float] = {}  # job -> until when a worker may still hold steps as once asked

    def forget(self, job: str) -> None:
        for table in (self._attended, self._paced, self.read_pace, self.send_pace, self._slow_until,
                      self._held_until):
            table.pop(job, None)

    def collective_report_s(self, job: str) -> float:
        """The longest a rank's collectives may go unreported: its read period (its own, or the slower one asked
        for, which holds for one more of its periods after the pace is shortened: the read it had scheduled is
        still to come) plus a flush."""
        period = max(FR_READ_INTERVAL_S, self.read_pace.get(job, 0.0))
        if self._clock() < self._slow_until.get(job, 0.0):
            period = max(period, self._period_s)
        return period + FLUSH_INTERVAL_S

    def step_report_s(self, job: str, step_s: float) -> float:
        """The longest a rank's newest step may go unreported: a flush, or while its steps may be held back (asked,
        or asked until less than a hold ago), until the worker counts them stopped (1.5 of their intervals, taken
        here as `step_s`, or ``STEPS_STOPPED_AFTER_S``) or the hold ends, plus its next look."""
        send = self.send_pace.get(job, 0.0)
        if send <= 0 and self._clock() < self._held_until.get(job, 0.0):
            send = self._send_s
        if send <= 0:
            return FLUSH_INTERVAL_S
        return max(send, STEPS_STOPPED_AFTER_S, 1.5 * step_s) + FLUSH_INTERVAL_S

    def pace(self, snap: JobSnapshot, *, near_decision: bool) -> None:
        """Ask the job's workers to read their Flight Recorders slowly while the straggler detector is not near
        a decision, and at their own pace as soon as it is (`quiet_read_period_s`). A worker starts every
        stream at its own pace; each stream is told only when what it should do changes."""
        quiet_period = self._period_s
        if quiet_period <= 0:
            return
        now = self._clock()
        if near_decision:
            self._attended[snap.job] = now
        quiet = now - self._attended.setdefault(snap.job, now) >= self._after_s
        want = quiet_period if quiet else 0.0
        if self.read_pace.get(snap.job, 0.0) > want:
            self._slow_until[snap.job] = now + quiet_period
        self.read_pace[snap.job] = want
        connected = [r for r in snap.ranks if r.connected]
        # the job's progress is its newest step: a rank with none must not leave the others' steps unheard
        send = self._send_s if quiet and connected and all(r.step_count > 0 for r in connected) else 0.0
        if self.send_pace.get(snap.job, 0.0) > send:
            self._held_until[snap.job] = now + self._send_s
        self.send_pace[snap.job] = send
        told = self._paced.setdefault(snap.job, {})
        streams = {r.rank: (r.pid, r.streams) for r in snap.ranks}
        # a new stream (a new process, or the same one reconnected) starts at the worker's own pace
        asked = {rank: pace for rank, (stream, pace) in told.items() if streams.get(rank) == stream}
        stale = [r.rank for r in connected if asked.get(r.rank, (0.0, 0.0)) != (want, send)]
        if not stale:
            return
        for rank in self._actions.set_read_pace(snap.job, stale, want, send):
            told[rank] = (streams[rank], (want, send))
        log.debug("job %s: ranks %s asked to read their Flight Recorders %s%s", snap.job, ",".join(map(str, stale)),
                  f"at most every {want:g} s (no detector near a decision)" if quiet else "at their own pace again",
                  f", and to send steps that keep ending every {send:g} s" if send else "", extra={"job": snap.job})

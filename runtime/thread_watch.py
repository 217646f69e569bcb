"""Where the training thread is, for the agent's hang detection: ``ThreadWatch``, used by the telemetry client
(runtime/agent_client.py) at each flush of its stream, on the sender thread, never on the training thread."""

from __future__ import annotations

import sys
import time

from trainwarden.agent.shared import telemetry_pb2 as pb
from trainwarden.runtime.flight_recorder import FlightRecorder

__all__ = ["STILL_REFRESH_S", "STILL_REPORT_AFTER_S", "ThreadWatch"]

STILL_REPORT_AFTER_S = 0.5
"""The training thread is reported still once its innermost frame has not moved for this long
(``ThreadWatch.check``)."""
STILL_REFRESH_S = 5.0
"""While the thread stays still, the agent ages the last report itself; it hears again when the oldest collective
in flight changes, on a new stream, and at least this often (a report lost with a stream costs no more)."""



class ThreadWatch:
    """The training thread's last known place, and what the agent was last told of it."""

    def __init__(self, thread: int, flight_recorder: FlightRecorder | None) -> None:
        self._thread, self._fr = thread, flight_recorder
        self._where: tuple[int, int] | None = None  # the training thread's innermost frame and instruction
        self._where_since = 0.0  # (monotonic) since when it has been there
        self._still_said = False  # the agent was last told the thread is still
        self._still_sent: tuple[float, int] | None = None  # when (monotonic) it was told, and of which collective
        self._nothing_pending_until = 0.0  # (monotonic) a dump found no collective in flight: none needed before
        self.reads = 0
        """Flight Recorder dumps this check took, and their CPU seconds (``rt.stats``)."""
        self.read_cpu_s = 0.0

    def new_stream(self) -> None:
        """A new stream (perhaps a restarted agent): it hears where the thread is at the next check."""
        self._still_sent = None

    def check(self, stepped: bool = False) -> pb.WorkerMessage | None:
        """Where the training thread is, when the agent should hear of it: once its innermost frame and
        instruction have not changed for `STILL_REPORT_AFTER_S` (with how long its oldest collective has been in
        flight), again when that collective changes or `STILL_REFRESH_S` has passed, and once when the thread
        moves again. The agent ages a report itself, so an idle rank costs no message a flush.

        A rank of a GPU job blocked in a hung collective spins a core inside one CUDA synchronize (`loss.item()`
        or the next copy waits for NCCL's stream), which looks like work to a CPU reading. Its Python frame does
        not move, and its collective does not complete. One `sys._current_frames()` per flush, with no reference
        kept to the frame (its locals would stay alive); a Flight Recorder dump only while the thread is still.
        The sample is taken when this thread gets the GIL, so a tight Python loop, which hands the GIL over at
        the same few instructions of a frame that is freed and reallocated at the same address, can look still
        too, and so can a loop of short native calls from one line (a CPU step's matmuls): the collective in
        flight is what says waiting, and it only matters while no rank of the job makes a step.

        What keeps that cheap (a dump of the whole ring costs 1.5-6 ms with the GIL held; every flush of a
        matmul-bound CPU job used to pay one, more than the periodic reads, issue 48): a step that ended since
        the last flush (``stepped``) means the thread moves, whatever the sample says; and once a dump found no
        collective of the thread in flight, the next comes no sooner than `STILL_REFRESH_S` later while the
        thread stays where it is (inside one call it enqueues nothing new; a collective it blocks in was in the
        ring before it blocked, so a hang's first dump finds it, and every flush dumps while one is pending)."""
        frame = sys._current_frames().get(self._thread)
        where = None if frame is None else (id(frame), frame.f_lasti)
        del frame
        now = time.monotonic()
        if where != self._where or stepped:
            self._where, self._where_since = where, now
            self._nothing_pending_until = 0.0
        still = now - self._where_since if where is not None else 0.0
        if still >= STILL_REPORT_AFTER_S:
            since = 0
            if self._fr is not None and self._fr.available and now >= self._nothing_pending_until:
                cpu = time.thread_time()
                since = self._fr.oldest_pending_ns(self._thread) or 0
                self.reads += 1
                self.read_cpu_s += time.thread_time() - cpu
                self._nothing_pending_until = 0.0 if since else now + STILL_REFRESH_S
            sent = self._still_sent
            if sent is not None and sent[1] == since and now - sent[0] < STILL_REFRESH_S:  # the agent knows
                return None
            self._still_said, self._still_sent = True, (now, since)
            pending = max(0.0, time.time() - since / 1e9) if since else 0.0
            return pb.WorkerMessage(training_thread=pb.TrainingThread(still_seconds=still,
                                                                      collective_pending_seconds=pending))
        if self._still_said:
            self._still_said, self._still_sent = False, None
            return pb.WorkerMessage(training_thread=pb.TrainingThread())
        return None

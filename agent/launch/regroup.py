"""Leaving and growing a running job without losing a step: the part of ``trainwarden run`` (agent/launch/run.py)
that has every worker save after one agreed step and hold, before the rendezvous round changes.

* **Leaving** (a drain's SIGUSR1, or the straggler policy's exclusion): this node writes
  ``jobs/<job>/leave/<round>``; every node's workers save after the step in it and hold; the leaver stops its
  torchrun once that checkpoint is committed, the others ask theirs to regroup (``restart <round>`` on the
  reply pipe), and the next round forms without the leaver.
* **Growing** (nodes wait to join a healthy round): the nodes agree on a step in ``jobs/<job>/grow/<round>``,
  every worker saves after it and holds, and torchrun gets ``go`` once it is committed.

``Regrouping`` is a part the run owns, not a mixin: it reads the current worker round (worker_round.py) and the
pace of the steps it is given, the job's leave and grow records through a ``LeaveLedger`` (``EtcdLeaves`` in etcd;
tests give fakes), and decides: which step, who steps out, when to answer torchrun. What acts is passed in once the
node entered the job (``joined``): asking the local workers to checkpoint, answering torchrun. Stopping this node's
workers once it left stays with the run (``left``, ``left_words``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Protocol, TextIO

import psutil

from trainwarden.agent.etcd.client import describe_etcd_error
from trainwarden.agent.etcd.cluster import LeaveWatch, agree_checkpoint_step, request_leave
from trainwarden.agent.launch.elastic import GROW_WAIT_S
from trainwarden.agent.launch.worker_round import WorkerRound

__all__ = ["GROW_MARGIN_STEPS", "GROW_MARGIN_S", "RECENT_DURATIONS", "EtcdLeaves", "LeaveLedger", "Regrouping"]

logger = logging.getLogger("trainwarden.agent.launch.run")  # the run's log, as before the split

GROW_MARGIN_STEPS, GROW_MARGIN_S = 3, 3.0
"""Before the job grows, every worker checkpoints after one agreed step: the proposing node's latest step plus
at least this many steps and this many seconds of steps, so that no rank on any node has passed it by the time
the request reaches it (ranks of a synchronous job are within a step or two of each other; the request reaches
every node within a second or two). Fast jobs get the seconds; 3 steps is the floor for slow ones: 5 were 45 s
at the 9 s steps of a degraded link on the bed, most of the minute between naming the node and the spare stepping
in (issue 47)."""

RECENT_DURATIONS = 20
"""The step durations (every local rank's) ``step_ahead`` takes the job's pace from: the recent ones, so that a job
slowed by the fault that makes a node leave (a degraded link: steps several times longer) gets a margin of
GROW_MARGIN_S at its pace now, not at its healthy pace (issue 47: at 3x slower, 11 steps of a healthy 0.3 s took
about 16 s more before the spare could step in)."""

NEWEST_DURATIONS = 4
"""The step durations (every local rank's) ``step_ahead`` counts the steps finished since the newest report with:
the pace of the last step or two. At the 20-step median, a job whose link had just slowed its steps from 1.2 to 9 s
was credited with 5 steps for the 6 s since its newest report, where it had finished none: the bed's swap agreed on
a step 8 ahead, 70 s at the slow pace (issue 47). A job that just sped up is credited with more, which only
lengthens the margin."""

LEFT = object()
"""``supervise``'s answer when this node left the job on request (SIGUSR1, a drain); the job goes on."""


class LeaveLedger(Protocol):
    """The job's leave and grow records and its latest checkpoint, as every node sees them (``EtcdLeaves``).
    Each call may wait on etcd and raise when it does not answer."""

    def refresh(self) -> None:
        """Read the leave requests and this node's exclusion again where needed (agent/etcd/cluster.py LeaveWatch)."""

    def excluded(self) -> bool:
        """A policy (``--straggler-policy exclude``) asked for this node to be left out of the job."""

    def request(self, round_key: str) -> dict | None:
        """Round ``round_key``'s leave request as last seen: ``{"node", "step", ...}``."""

    def ask(self, round_key: str, step: int, *, cause: str, ranks: list[int], reason: str) -> dict:
        """Ask for this node to leave after ``step``; the request that stands (this one or an earlier one)."""

    def agree(self, round_key: str, proposal: int) -> tuple[int, str]:
        """The step every node checkpoints after before round ``round_key`` grows, and the node that proposed it."""

    def checkpoint(self) -> dict:
        """The job's latest published checkpoint pointer (``{}``: none)."""

    def stop(self) -> None:
        """Stop watching."""


class EtcdLeaves:
    """``LeaveLedger`` in etcd: ``jobs/<job>/leave/<round>``, ``jobs/<job>/exclude/<node>``, ``jobs/<job>/grow/
    <round>`` and ``jobs/<job>/checkpoint`` (agent/etcd/cluster.py, agent/etcd/job_records.py)."""

    def __init__(self, client, records, job: str, node: str) -> None:
        self._client, self._records, self._job, self._node = client, records, job, node
        self._watch: LeaveWatch | None = None

    def refresh(self) -> None:
        if self._watch is None:
            self._watch = LeaveWatch(self._client, self._job, self._node)
        self._watch.refresh()  # asks etcd only when a watch is gone (and every LEAVE_REREAD_S)

    def excluded(self) -> bool:
        return self._watch is not None and self._watch.excluded()

    def request(self, round_key: str) -> dict | None:
        return None if self._watch is None else self._watch.request(round_key)

    def ask(self, round_key: str, step: int, *, cause: str, ranks: list[int], reason: str) -> dict:
        return request_leave(self._client, self._job, round_key, self._node, step, cause=cause, ranks=ranks,
                             reason=reason)

    def agree(self, round_key: str, proposal: int) -> tuple[int, str]:
        return agree_checkpoint_step(self._client, self._job, round_key, proposal, self._node)

    def checkpoint(self) -> dict:
        return self._records.get_checkpoint(self._job) or {}

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.stop()


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _spawn_thread(target, *args) -> None:
    threading.Thread(target=target, args=args, name="trainwarden-leave", daemon=True).start()


class Regrouping:
    """The leave and grow protocols of one ``trainwarden run`` (module docstring).

    ``worker_round``: the run's current worker round (it replaces it as rounds start); ``pace``: the median of the
    last N step durations (None: no steps yet); ``spawn(target, *args)``: runs a leave's steps beside the watcher (a
    daemon thread; tests run them in place). Before ``joined`` a leave can be asked for but nothing acts on it.
    """

    def __init__(self, *, job: str, node: str, multi_node: bool, out: TextIO,
                 worker_round: Callable[[], WorkerRound], pace: Callable[[int], float | None],
                 spawn: Callable[..., None] | None = None) -> None:
        self.job, self.node, self.multi_node, self._out = job, node, multi_node, out
        self._round, self._pace, self._spawn = worker_round, pace, spawn or _spawn_thread
        self._ledger: LeaveLedger | None = None
        self._checkpoint: Callable[[int], list[int]] | None = None
        self._reply: Callable[[bytes], None] = lambda line: None
        self._launcher_running: Callable[[], bool] = lambda: False
        self._leave_asked = threading.Event()  # SIGUSR1: leave the job at a step boundary (a drain)
        self._left = threading.Event()  # this node's part is over: stop the workers, exit 0
        self.left_step: int | None = None
        self._leave_rounds: set = set()  # rounds whose leave request this node has acted on
        self._leave_done: dict = {}  # round -> Event set once that leave's checkpoint is settled
        self._asked_leave_round = None
        self._leave_cause, self._leave_reason = "drain", ""  # a policy's exclusion says "excluded" and why
        self._leave_polled = 0.0
        self._committed_step = 0  # the latest checkpoint step a local worker reported committed
        self._failed_step = 0  # the latest checkpoint step a local worker reported failed (or fenced)

    def joined(self, ledger: LeaveLedger, *, checkpoint: Callable[[int], list[int]] | None,
               reply: Callable[[bytes], None], launcher_running: Callable[[], bool]) -> None:
        """This node entered the job: the job's records, what asks this node's workers to save after a step and
        hold (the ranks asked; None without the node agent), what answers torchrun on its reply pipe, and whether
        torchrun still runs."""
        self._ledger, self._checkpoint = ledger, checkpoint
        self._reply, self._launcher_running = reply, launcher_running

    # ---- what the run tells it --------------------------------------------------------------------------

    def on_leave_signal(self, signum, frame) -> None:
        self._leave_asked.set()

    def ask_to_leave(self, cause: str, reason: str) -> None:
        """A policy excluded this node (``cause``, ``reason`` go in the leave record for the spare)."""
        self._leave_cause, self._leave_reason = cause, reason
        self._leave_asked.set()

    @property
    def leave_asked(self) -> bool:
        return self._leave_asked.is_set()

    @property
    def left(self) -> bool:
        """This node's part is over: the run stops its workers and exits 0."""
        return self._left.is_set()

    def left_words(self) -> str:
        return f"after the checkpoint of step {self.left_step}" if self.left_step else \
            "without a new checkpoint (it was not committed in time)"

    def checkpoint_reported(self, stage: str, step: int) -> None:
        """A local worker's checkpoint record: ``committed`` or ``failed`` (or fenced) at ``step``."""
        if stage == "committed":
            self._committed_step = max(self._committed_step, step)
        elif stage == "failed":
            self._failed_step = max(self._failed_step, step)

    # ---- leaving the job on request (SIGUSR1: a drain) ------------------------------------------------

    def watch(self, done: threading.Event) -> None:
        """The leave protocol's watcher (a thread beside the supervise loop), until ``done``."""
        try:
            while not done.wait(0.5):
                self.poll()
        finally:
            if self._ledger is not None:
                self._ledger.stop()

    def poll(self) -> None:
        """Ask for this node's leave when told to, and act on the round's leave request, whichever node made it
        (module docstring; agent/etcd/cluster.py). etcd calls here may take the client's timeout; nothing else
        waits for them."""
        round_ = self._round().number
        if self._leave_asked.is_set() and not self.multi_node and not self._leave_rounds:
            self._leave_rounds.add(round_)
            self._spawn(self._leave_alone)
            return
        if not self.multi_node or round_ is None or self._checkpoint is None or self._ledger is None \
                or round_ in self._leave_rounds:
            return
        now = time.monotonic()
        if now - self._leave_polled < 1.0:
            return
        self._leave_polled = now
        try:
            key = str(round_)
            self._ledger.refresh()
            if not self._leave_asked.is_set() and self._ledger.excluded():
                print(f"trainwarden: node {self.node} is to be left out of job {self.job} (straggler policy "
                      "exclude); it leaves at a step boundary after a checkpoint", file=self._out, flush=True)
                self.ask_to_leave("excluded", "straggler policy exclude")
            standing = None
            if self._leave_asked.is_set() and self._asked_leave_round != round_:
                self._asked_leave_round = round_
                standing = self._ledger.ask(key, self.step_ahead(), cause=self._leave_cause,
                                            ranks=list(self._round().ranks), reason=self._leave_reason)
            request = self._ledger.request(key) or standing
        except Exception as exc:
            logger.debug("cannot read the job's leave requests: %s", describe_etcd_error(exc))
            return
        if request is not None:
            self._leave_rounds.add(round_)
            self._leave_done[round_] = threading.Event()
            self._spawn(self._on_leave, request, round_)

    def step_ahead(self) -> int:
        """A step no rank of the job has passed by the time a request for it reaches every node (GROW_MARGIN_*)."""
        median = self._pace(RECENT_DURATIONS) or 1.0
        newest = self._pace(NEWEST_DURATIONS) or median
        # steps arrive in batches (the runtime sends every `ClientConfig.flush_interval_s`): count the ones
        # the ranks have most likely finished since the newest one reported, at the pace of the newest ones
        current = self._round()
        behind = min(10.0, max(0.0, time.time() - current.step_end)) if current.step_end else 0.0
        return current.step + int(behind / newest) + max(GROW_MARGIN_STEPS, int(GROW_MARGIN_S / median) + 1)

    def _on_leave(self, request: dict, round_) -> None:
        """Node ``request["node"]`` leaves after step ``request["step"]``: every local worker saves after it and
        holds; once it is committed the leaver stops its workers and the others regroup without it."""
        leaver, step = request["node"], request["step"]
        me = leaver == self.node
        try:
            asked = self._checkpoint(step)
            print(f"trainwarden: node {leaver} leaves job {self.job}: every worker checkpoints after step {step} "
                  f"and waits there; this node asked rank{'s' if len(asked) != 1 else ''} "
                  f"{','.join(map(str, asked)) or 'none'}", file=self._out, flush=True)
            committed = self._wait_for_commit(step)
        finally:
            self._leave_done[round_].set()
        if me:
            self.left_step = step if committed else None
            self._left.set()
        else:
            print(f"trainwarden: node {leaver} has left; the job regroups without it"
                  f"{f' from step {step}' if committed else ''}", file=self._out, flush=True)
            self._reply(f"restart {round_}\n".encode())  # for this round only: stale once the group regrouped

    def _leave_alone(self) -> None:
        """A one-node job asked to leave: checkpoint at a step boundary, then stop (resumable from it)."""
        step = self.step_ahead()
        if self._checkpoint is not None:
            self._checkpoint(step)
            print(f"trainwarden: leaving job {self.job}: the workers checkpoint after step {step}",
                  file=self._out, flush=True)
            self.left_step = step if self._wait_for_commit(step) else None
        self._left.set()

    def _wait_for_commit(self, step: int) -> bool:
        """Until the checkpoint of ``step`` is committed (True), or it cannot be: a local worker died, its save
        failed, torchrun ended, or GROW_WAIT_S passed."""
        deadline = time.monotonic() + GROW_WAIT_S - 10.0
        workers = self._workers()
        while time.monotonic() < deadline and self._launcher_running():
            if self._committed(step):
                return True
            if self._failed_step >= step or any(not _alive(w) for w in workers):
                break
            time.sleep(0.5)
        print(f"trainwarden: the checkpoint of step {step} was not committed; going on from the latest one there is",
              file=self._out, flush=True)
        return False

    # ---- growing: a checkpoint at one step on every node, then the membership restart ----------------------

    def before_growing(self, round_: int | None) -> None:
        """Nodes wait to join this healthy round and torchrun waits for our ``go`` to restart the workers
        into a larger world (agent/launch/elastic.py). Every node agrees on one step in etcd, has its workers
        save after it and hold, and answers ``go`` once that checkpoint is committed: the new round restores
        it and loses no step. Whatever goes wrong, ``go`` is answered: the restart then replays the steps
        since the latest checkpoint, as it would without this."""
        done = self._leave_done.get(round_)
        if done is not None:  # a node leaves in this round: its checkpoint is the one the restart resumes from
            done.wait(GROW_WAIT_S)
            if not self._left.is_set():
                self._reply(b"go\n")
            return
        try:
            self._grow_checkpoint(round_)
        except Exception as exc:
            print(f"trainwarden: no checkpoint before the job grows ({describe_etcd_error(exc)}); it restarts "
                  "from the latest one, replaying the steps since", file=self._out, flush=True)
        finally:
            self._reply(b"go\n")

    def _grow_checkpoint(self, round_: int | None) -> None:
        job = self.job
        if self._checkpoint is None or self._ledger is None:
            print("trainwarden: nodes wait to join; without the node agent the workers cannot checkpoint on request: "
                  "restarting from the latest checkpoint", file=self._out, flush=True)
            return
        proposal = self.step_ahead()
        step, proposer = self._ledger.agree("round-unknown" if round_ is None else str(round_), proposal)
        asked = self._checkpoint(step)
        print(f"trainwarden: nodes wait to join job {job}: every worker checkpoints after step {step} (proposed by "
              f"{proposer}) and waits there; this node asked rank{'s' if len(asked) != 1 else ''} "
              f"{','.join(map(str, asked)) or 'none'}", file=self._out, flush=True)
        if self._wait_for_commit(step):
            print(f"trainwarden: checkpoint of step {step} committed; the job restarts with the waiting nodes",
                  file=self._out, flush=True)

    def _workers(self) -> list[psutil.Process]:
        procs = []
        for pid in self._round().pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.Error:
                pass
        return procs

    def _committed(self, step: int) -> bool:
        """The checkpoint of ``step`` (or a later one) is committed: reported by a worker of this node (the
        committing rank), or published in etcd by the node that has it."""
        if self._committed_step >= step:
            return True
        try:
            pointer = self._ledger.checkpoint() if self._ledger is not None else {}
        except Exception:  # etcd away: the local report may still come
            return False
        return int(pointer.get("step") or 0) >= step

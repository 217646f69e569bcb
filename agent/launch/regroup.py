"""Leaving and growing a running job without losing a step: the part of ``trainwarden run`` (agent/launch/run.py)
that has every worker save after one agreed step and hold, before the rendezvous round changes.

* **Leaving** (a drain's SIGUSR1, or the straggler policy's exclusion): this node writes
  ``jobs/<job>/leave/<round>``; every node's workers save after the step in it and hold; the leaver stops its
  torchrun once that checkpoint is committed, the others ask theirs to regroup (``restart <round>`` on the
  reply pipe), and the next round forms without the leaver.
* **Growing** (nodes wait to join a healthy round): the nodes agree on a step in ``jobs/<job>/grow/<round>``,
  every worker saves after it and holds, and torchrun gets ``go`` once it is committed.

``Regrouping`` is a mixin of ``_JobRun``: it uses the run's state (options, etcd client, agent, the current worker
round of worker_round.py) and is not meant to stand alone.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import psutil

from trainwarden.agent.common.job_lifecycle import JobPhase
from trainwarden.agent.etcd.client import describe_etcd_error
from trainwarden.agent.etcd.cluster import LeaveWatch, agree_checkpoint_step, request_leave
from trainwarden.agent.launch.elastic import GROW_WAIT_S

__all__ = ["GROW_MARGIN_STEPS", "GROW_MARGIN_S", "RECENT_DURATIONS", "Regrouping"]

logger = logging.getLogger("trainwarden.agent.launch.run")  # the run's log, as before the split

GROW_MARGIN_STEPS, GROW_MARGIN_S = 3, 3.0
"""Before the job grows, every worker checkpoints after one agreed step: the proposing node's latest step plus
at least this many steps and this many seconds of steps, so that no rank on any node has passed it by the time
the request reaches it (ranks of a synchronous job are within a step or two of each other; the request reaches
every node within a second or two). Fast jobs get the seconds; 3 steps is the floor for slow ones: 5 were 45 s
at the 9 s steps of a degraded link on the bed, most of the minute between naming the node and the spare stepping
in (issue 47)."""

RECENT_DURATIONS = 20
"""The step durations (every local rank's) ``_step_ahead`` takes the job's pace from: the recent ones, so that a job
slowed by the fault that makes a node leave (a degraded link: steps several times longer) gets a margin of
GROW_MARGIN_S at its pace now, not at its healthy pace (issue 47: at 3x slower, 11 steps of a healthy 0.3 s took
about 16 s more before the spare could step in)."""

_LEFT = object()
"""``supervise``'s answer when this node left the job on request (SIGUSR1, a drain); the job goes on."""


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Regrouping:
    """The leave and grow protocols of one ``trainwarden run`` (module docstring)."""

    # ---- leaving the job on request (SIGUSR1: a drain) ------------------------------------------------

    def on_leave_signal(self, signum, frame) -> None:
        self._leave_asked.set()

    def _watch_leave_loop(self, done: threading.Event) -> None:
        try:
            while not done.wait(0.5):
                self._watch_leave()
        finally:
            leaves = getattr(self, "_leaves", None)
            if leaves is not None:
                leaves.stop()

    def _watch_leave(self) -> None:
        """The leave protocol's watcher (a thread beside the supervise loop): ask for this node's leave when told
        to, and act on the round's leave request, whichever node made it (module docstring;
        agent/etcd/cluster.py). etcd calls here may take the client's timeout; nothing else waits for them."""
        round_ = self.worker_round.number
        if self._leave_asked.is_set() and not self._multi_node and not self._leave_rounds:
            self._leave_rounds.add(round_)
            self._spawn(self._leave_alone)
            return
        if not self._multi_node or round_ is None or self.agent is None or round_ in self._leave_rounds:
            return
        now = time.monotonic()
        if now - getattr(self, "_leave_polled", 0.0) < 1.0:
            return
        self._leave_polled = now
        try:
            key = str(round_)
            if getattr(self, "_leaves", None) is None:
                self._leaves = LeaveWatch(self.client, self.opts.job, self.node)
            self._leaves.refresh()  # asks etcd only when a watch is gone (and every LEAVE_REREAD_S)
            if not self._leave_asked.is_set() and self._leaves.excluded():
                print(f"trainwarden: node {self.node} is to be left out of job {self.opts.job} (straggler policy "
                      "exclude); it leaves at a step boundary after a checkpoint", file=self.out, flush=True)
                self._leave_cause, self._leave_reason = "excluded", "straggler policy exclude"
                self._leave_asked.set()
            standing = None
            if self._leave_asked.is_set() and self._asked_leave_round != round_:
                self._asked_leave_round = round_
                standing = request_leave(self.client, self.opts.job, key, self.node, self._step_ahead(),
                                         cause=self._leave_cause, ranks=list(self.worker_round.ranks),
                                         reason=self._leave_reason)
            request = self._leaves.request(key) or standing
        except Exception as exc:
            logger.debug("cannot read the job's leave requests: %s", describe_etcd_error(exc))
            return
        if request is not None:
            self._leave_rounds.add(round_)
            self._leave_done[round_] = threading.Event()
            self._spawn(self._on_leave, request, round_)

    def _step_ahead(self) -> int:
        """A step no rank of the job has passed by the time a request for it reaches every node (GROW_MARGIN_*)."""
        median = self.progress.median_step_seconds(RECENT_DURATIONS) or 1.0
        # steps arrive in batches (the runtime sends every `ClientConfig.flush_interval_s`): count the ones
        # the ranks have most likely finished since the newest one reported
        current = self.worker_round
        behind = min(10.0, max(0.0, time.time() - current.step_end)) if current.step_end else 0.0
        return current.step + int(behind / median) + max(GROW_MARGIN_STEPS, int(GROW_MARGIN_S / median) + 1)

    def _spawn(self, target, *args) -> None:
        threading.Thread(target=target, args=args, name="trainwarden-leave", daemon=True).start()

    def _on_leave(self, request: dict, round_) -> None:
        """Node ``request["node"]`` leaves after step ``request["step"]``: every local worker saves after it and
        holds; once it is committed the leaver stops its workers and the others regroup without it."""
        leaver, step = request["node"], request["step"]
        me = leaver == self.node
        try:
            asked = self.agent.actions.request_checkpoint(self.opts.job, step, hold=True)
            print(f"trainwarden: node {leaver} leaves job {self.opts.job}: every worker checkpoints after step {step} "
                  f"and waits there; this node asked rank{'s' if len(asked) != 1 else ''} "
                  f"{','.join(map(str, asked)) or 'none'}", file=self.out, flush=True)
            committed = self._wait_for_commit(step)
        finally:
            self._leave_done[round_].set()
        if me:
            self._left_step = step if committed else None
            self._left.set()
        else:
            print(f"trainwarden: node {leaver} has left; the job regroups without it"
                  f"{f' from step {step}' if committed else ''}", file=self.out, flush=True)
            self._reply(f"restart {round_}\n".encode())  # for this round only: stale once the group regrouped

    def _leave_alone(self) -> None:
        """A one-node job asked to leave: checkpoint at a step boundary, then stop (resumable from it)."""
        step = self._step_ahead()
        if self.agent is not None:
            self.agent.actions.request_checkpoint(self.opts.job, step, hold=True)
            print(f"trainwarden: leaving job {self.opts.job}: the workers checkpoint after step {step}",
                  file=self.out, flush=True)
            self._left_step = step if self._wait_for_commit(step) else None
        self._left.set()

    def _finish_leave(self) -> object:
        self.pump.quiet = True
        self.torchrun.stop(grace=10.0)  # SIGTERM: torchrun does not close the rendezvous on a signal
        self.pump.join(5)
        self.events.join(5)
        saved = f"after the checkpoint of step {self._left_step}" if self._left_step else \
            "without a new checkpoint (it was not committed in time)"
        if self._multi_node:
            print(f"trainwarden: node {self.node} left job {self.opts.job} {saved}; the job goes on without it",
                  file=self.out, flush=True)
            return _LEFT
        self.transition(JobPhase.STOPPED, f"drained {saved}")
        print(f"trainwarden: job {self.opts.job} stopped {saved} (its node was drained); resume it on another "
              "node from that checkpoint", file=self.out, flush=True)
        return _LEFT

    def _wait_for_commit(self, step: int) -> bool:
        """Until the checkpoint of ``step`` is committed (True), or it cannot be: a local worker died, its save
        failed, torchrun ended, or GROW_WAIT_S passed."""
        deadline = time.monotonic() + GROW_WAIT_S - 10.0
        workers = self._workers()
        while time.monotonic() < deadline and self.torchrun is not None and self.torchrun.poll() is None:
            if self._committed(step):
                return True
            if self._failed_step >= step or any(not _alive(w) for w in workers):
                break
            time.sleep(0.5)
        print(f"trainwarden: the checkpoint of step {step} was not committed; going on from the latest one there is",
              file=self.out, flush=True)
        return False

    def _reply(self, line: bytes) -> None:
        try:
            os.write(self._reply_fd, line)
        except (OSError, TypeError):
            pass  # torchrun is gone, or was started without the pipe: nothing waits for us

    # ---- growing: a checkpoint at one step on every node, then the membership restart ----------------------

    def _checkpoint_before_growing(self, round_: int | None) -> None:
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
                  "from the latest one, replaying the steps since", file=self.out, flush=True)
        finally:
            self._reply(b"go\n")

    def _grow_checkpoint(self, round_: int | None) -> None:
        job = self.opts.job
        if self.agent is None or self.client is None:
            print("trainwarden: nodes wait to join; without the node agent the workers cannot checkpoint on request: "
                  "restarting from the latest checkpoint", file=self.out, flush=True)
            return
        proposal = self._step_ahead()
        step, proposer = agree_checkpoint_step(self.client, job, "round-unknown" if round_ is None else str(round_),
                                               proposal, self.node)
        asked = self.agent.actions.request_checkpoint(job, step, hold=True)
        print(f"trainwarden: nodes wait to join job {job}: every worker checkpoints after step {step} (proposed by "
              f"{proposer}) and waits there; this node asked rank{'s' if len(asked) != 1 else ''} "
              f"{','.join(map(str, asked)) or 'none'}", file=self.out, flush=True)
        if self._wait_for_commit(step):
            print(f"trainwarden: checkpoint of step {step} committed; the job restarts with the waiting nodes",
                  file=self.out, flush=True)

    def _workers(self) -> list[psutil.Process]:
        procs = []
        for pid in self.worker_round.pids:
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
            pointer = self.records.get_checkpoint(self.opts.job) or {}
        except Exception:  # etcd away: the local report may still come
            return False
        return int(pointer.get("step") or 0) >= step

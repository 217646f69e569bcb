"""What each of the launcher's structured events (agent/launch/elastic.py: ``started``, ``failed``, ``waiting``,
``membership_pending``, ``restarting``) changes in ``trainwarden run`` (agent/launch/run.py).

``RoundEvents`` is a part the run owns: it holds this node's current worker round (worker_round.py, replaced at each
``started``) and tells the run's other parts what happened, each through what it is given: the progress, the
accounting, the stop verdict (stop_verdict.py), fencing's round in etcd, the grow protocol (regroup.py), the spare
gauges, and (``attach``, once they exist) the run record, the worker-failure recorder, the membership record and the
spare take-over. A phase change goes through the run's ``transition``.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, TextIO

from trainwarden.agent.common.job_lifecycle import JobPhase
from trainwarden.agent.incidents.worker_failures import describe_failures
from trainwarden.agent.launch.accounting import Accounting
from trainwarden.agent.launch.progress import JobProgress
from trainwarden.agent.launch.spare_swaps import SpareSwaps
from trainwarden.agent.launch.stop_verdict import StopVerdict
from trainwarden.agent.launch.worker_round import WorkerRound

__all__ = ["RoundEvents"]


class RoundEvents:
    """The launcher's events, read on the event reader's thread (module docstring). ``generation``: the job's
    current generation (a take-over moves it); ``advance_round``: record a round as the job's current one in etcd
    (fencing.py; it may wait on etcd: run on a thread of its own); ``before_growing``: the grow protocol's
    checkpoint before nodes join (regroup.py; a thread of its own too)."""

    def __init__(self, *, job: str, node: str, spare_nodes: int, multi_node: bool, out: TextIO,
                 progress: JobProgress, accounting: Accounting, verdict: StopVerdict, spare_swaps: SpareSwaps,
                 generation: Callable[[], int], advance_round: Callable[[WorkerRound], None],
                 before_growing: Callable[[int | None], None], transition: Callable[..., None]) -> None:
        self.job, self.node, self.spare_nodes, self.multi_node, self._out = job, node, spare_nodes, multi_node, out
        self._progress, self._goodput, self._history = progress, accounting.goodput, accounting.history
        self._verdict, self._spare_swaps, self._generation = verdict, spare_swaps, generation
        self._advance_round, self._before_growing, self._transition = advance_round, before_growing, transition
        self.current = WorkerRound()  # this node's current worker round: replaced as each one starts
        self._run_record = self._failures = self._membership = self._spares = None
        self._killed: Callable[[int], bool] = lambda pid: False
        self._growing: threading.Thread | None = None

    def attach(self, *, run_record, failures, membership, spares, killed: Callable[[int], bool] | None) -> None:
        """The run's parts made by its steps: the run record (its workers' pids), the worker-failure recorder, the
        membership record and the spare take-over (None: not this run's), and ``killed``: a pid the agent killed."""
        self._run_record, self._failures, self._membership, self._spares = run_record, failures, membership, spares
        self._killed = killed or (lambda pid: False)

    def on_event(self, event: dict) -> None:
        """The launcher's structured events: rounds, failures with exit codes, restarts."""
        kind, at = event.get("event"), float(event.get("t") or time.time())
        if kind == "started":
            self._started(event, at)
        elif kind == "failed":
            self._failed(event.get("failures") or [], at)
        elif kind == "waiting":  # the round closed without this node: a hot spare, or a node that came late
            spare = "a hot spare: it takes a lost node's ranks" if self.spare_nodes else "it joins when the job grows"
            print(f"trainwarden: node {self.node} waits in round {event.get('round')} of job {self.job}: the "
                  f"running round has its nodes; {spare}", file=self._out, flush=True)
            self._history.event("waiting", at, round=event.get("round"))
            if self._membership is not None:  # `trainwarden status --etcd` shows it as a spare
                self._membership.update(spare=True, ranks=[], round=event.get("round"))
            self._spare_swaps.waiting(True)  # trainwarden_job_spare_nodes
        elif kind == "membership_pending":  # nodes wait to join: checkpoint first, so no step is lost
            self._growing = threading.Thread(target=self._before_growing, args=(event.get("round"),),
                                             name="trainwarden-grow", daemon=True)
            self._growing.start()
        elif kind == "restarting":
            self._restarting(event, at)

    def _started(self, event: dict, at: float) -> None:
        self.current = started = WorkerRound.started(self._generation(), event)
        if self.multi_node and started.number is not None:  # the job's current round is this one now
            threading.Thread(target=self._advance_round, args=(started,), name="trainwarden-round",
                             daemon=True).start()
        self._progress.round_started(at)
        if self._failures is not None:  # a later failure's evidence: this round's streams only
            self._failures.round_started(at)
        self._goodput.round_started(at, spare_swap=bool(event.get("spare_swap")))
        self._history.event("round_started", at, round=started.number, workers=len(event.get("workers") or []))
        self._run_record.set_workers(list(started.pids))
        if self._membership is not None:  # a node_lost incident names the ranks of the node's last round
            self._membership.update(ranks=list(started.ranks), round=started.number, spare=False)
        self._spare_swaps.waiting(False)  # trainwarden_job_spare_nodes: this node trains
        if self._spares is not None:
            self._spares.round_started(started.number, [w["global_rank"] for w in event.get("workers") or []])

    def _failed(self, failures: list[dict], at: float) -> None:
        self._progress.round_failed(at)
        self._goodput.failed(at)
        self._history.event("round_failed", at, failures=[
            {"rank": f.get("global_rank"), "exitcode": f.get("exitcode"), "message": str(f.get("message") or "")[:300]}
            for f in failures])
        if self._verdict.round_failed(failures, in_round=self._progress.in_round, killed=self._killed):
            return
        if self._failures is not None:
            self._failures.round_failed(failures)
        print(f"trainwarden: the worker round failed: {describe_failures(failures)}", file=self._out, flush=True)

    def _restarting(self, event: dict, at: float) -> None:
        after_failure = event.get("reason") == "failed"
        self._progress.restarting(after_failure)
        if after_failure and self._failures is not None:
            self._failures.restarting()
        why = {"failed": "worker group failed", "regroup": "a node left the job"}.get(
            event.get("reason"), "nodes are waiting to join")
        print(f"trainwarden: restarting the worker group ({why}; {event.get('restarts_left', '?')} restarts "
              "left)", file=self._out, flush=True)
        self._transition(JobPhase.RESTARTING, why, failure=after_failure)
        self._history.event("restarting", at, reason=event.get("reason") or "")

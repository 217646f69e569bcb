"""What the watchdog makes of a communication regression (agent/watchdog/comm_regression.py): one incident per
regression, open while it lasts and resolved when the step time is back, and the
``trainwarden_comm_regression{job,node}`` gauge (1 while regressed) with the ratio of the step time to its
baseline (``trainwarden_comm_regression_ratio``).

On a job of several nodes each node's agent judges its own ranks (their counters are local); every node of a
job whose links slowed sees it, and each records it for its ranks (the incident names them). Naming the node
or link is the link check's work (agent/linkcheck): when the launcher gives this watch a ``localize`` hook
(multi-node `trainwarden run`), a regression's start asks for one, on the hook's thread, and its report joins
the open incident's evidence (``link_check``) when it arrives, with one log line naming the node or pair.

A node's own ranks cannot tell a slower network from a slower rank on another node: either way every rank here
waits longer in collectives while its own compute stays flat. The node that holds the slow rank can: its
window is slow too, but a rank's compute grew there. So with a ``cluster`` (agent/etcd/cluster.py) each node
says when its latest window was slow off the links (a beacon, written only when that changes), and a node about
to record a regression first asks whether another node says so; while one does, it holds (the detector's
``elsewhere``). When etcd cannot be asked, the node judges alone for ``CLUSTER_RETRY_S``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from trainwarden.agent.incidents.record import Incident, IncidentKind, IncidentState, new_incident_id
from trainwarden.agent.telemetry.job_telemetry import JobSnapshot
from trainwarden.agent.watchdog.cluster_hang import CLUSTER_RETRY_S
from trainwarden.agent.watchdog.comm_regression import (CommRegressionConfig, CommRegressionDetector,
                                                        CommRegressionEvent, RankTotals)

__all__ = ["CommRegressionWatch", "rank_totals"]

log = logging.getLogger(__name__)


def rank_totals(snap: JobSnapshot) -> dict[int, RankTotals]:
    """The detector's input from a job's snapshot: its connected ranks' cumulative counters."""
    return {r.rank: RankTotals(steps=r.step_count, step_seconds=r.step_seconds_total,
                               wait_seconds=sum(c.wait_seconds for c in r.collectives), stage=r.checkpoint_stage,
                               pid=r.pid)
            for r in snap.ranks if r.connected}


class CommRegressionWatch:
    """Feeds the detector from the watchdog's snapshots; records incidents through ``record``."""

    def __init__(self, record: Callable[[Incident], Incident], *, node: str, clock: Callable[[], float],
                 wall: Callable[[], float], config: CommRegressionConfig | None = None, cluster=None) -> None:
        """``cluster``: the job's other nodes (a ``HangCoordinator``, agent/etcd/cluster.py), on jobs of several."""
        self._record, self._node, self._clock, self._wall = record, node, clock, wall
        self.detector = CommRegressionDetector(config)
        self._nodes = _OtherNodes(cluster, clock) if cluster is not None else None
        self._held: dict[str, list[str]] = {}  # job -> the other nodes that held its start back (said once)
        self._open: dict[str, Incident] = {}
        self.localize: Callable[[str, Callable[[dict], None]], object] | None = None
        """``localize(job, on_done)``: start a link check of ``job`` off this thread (agent/linkcheck)."""
        self._located: list[tuple[str, str, dict]] = []  # (job, incident id, report), from the hook's thread
        self._located_lock = threading.Lock()

    def check(self, snap: JobSnapshot) -> None:
        self._attach_link_checks()
        job = snap.job
        straggler = any("straggler" in r.flags for r in snap.ranks if r.connected)
        elsewhere = (lambda: self._nodes.slow_elsewhere(job)) if self._nodes is not None else None
        for event in self.detector.update(job, self._clock(), rank_totals(snap), straggler=straggler,
                                          elsewhere=elsewhere):
            self._on_event(snap, event)
        if self._nodes is not None:
            self._nodes.share(job, self.detector.slow_off_links(job))
        self._say_held(job)

    def _say_held(self, job: str) -> None:
        held_by = (self.detector.last_window(job) or {}).get("held_by") or []
        if not held_by:
            self._held.pop(job, None)
        elif self._held.get(job) != held_by:
            self._held[job] = held_by
            log.warning("job %s: this node's ranks wait longer in collectives, but node %s is slower in its own "
                        "ranks' work: not a communication regression while it is (a straggler there?)", job,
                        ",".join(held_by), extra={"job": job})

    def _ask_for_link_check(self, job: str, incident_id: str) -> None:
        localize = self.localize
        if localize is None:
            return

        def done(report: dict) -> None:
            with self._located_lock:
                self._located.append((job, incident_id, report))

        try:
            localize(job, done)
        except Exception:
            log.exception("job %s: could not start a link check", job)

    def _attach_link_checks(self) -> None:
        """The link checks' reports that arrived since the last check, into their incidents (if still open)."""
        with self._located_lock:
            located, self._located = self._located, []
        for job, incident_id, report in located:
            words = report.get("error") or report.get("summary", "")
            log.error("job %s: link check (run by node %s): %s", job, report.get("by", "?"), words,
                      extra={"job": job})
            incident = self._open.get(job)
            if incident is None or incident.id != incident_id:
                continue
            now = self._wall()
            updated = incident.transition(incident.state, now=now, outcome=f"regressed; link check: {words}")
            self._open[job] = self._record(dataclasses.replace(
                updated, evidence={**incident.evidence, "link_check": report}))

    def close_all(self, outcome: str) -> None:
        """Resolve every open regression incident: no end event will come (the agent stops)."""
        for job in list(self._open):
            self.forget(job, outcome)

    def forget(self, job: str, outcome: str = "the job ended during the regression") -> None:
        self.detector.forget(job)
        self._held.pop(job, None)
        if self._nodes is not None:
            self._nodes.forget(job)
        incident = self._open.pop(job, None)
        if incident is not None:
            self._record(incident.transition(IncidentState.RESOLVED, outcome=outcome, now=self._wall()))

    def _on_event(self, snap: JobSnapshot, event: CommRegressionEvent) -> None:
        now, job = self._wall(), snap.job
        if not event.started:
            incident = self._open.pop(job, None)
            log.warning("job %s: communication back to normal: steps %.3f s against a baseline of %.3f s", job,
                        event.step_s, event.baseline_step_s, extra={"job": job})
            if incident is not None:
                self._record(incident.transition(
                    IncidentState.RESOLVED, now=now,
                    outcome=f"step time back to {event.ratio:.2f}x its baseline after "
                            f"{now - incident.detected_at:.0f} s"))
            return
        grown_wait = [event.window[r].wait_s - event.baseline[r].wait_s for r in event.window]
        summary = (f"the job's steps take {event.ratio:.1f}x their baseline ({event.baseline_step_s:.3f} s -> "
                   f"{event.step_s:.3f} s): every rank here waits {min(grown_wait):.3f}-{max(grown_wait):.3f} s "
                   f"longer per step in collectives while its own compute stayed flat, so the network between "
                   f"the job's ranks is slower (a degraded link or node), not any rank's work")
        log.error("job %s: communication regression: %s", job, summary, extra={"job": job})
        evidence = {
            "summary": summary, "ratio": round(event.ratio, 3), "baseline_step_s": round(event.baseline_step_s, 6),
            "step_s": round(event.step_s, 6), "windows": event.windows,
            "step": max((r.last_step for r in snap.ranks), default=-1),
            "ranks": {str(r): {"baseline_step_s": round(event.baseline[r].step_s, 6),
                               "baseline_wait_s": round(event.baseline[r].wait_s, 6),
                               "step_s": round(event.window[r].step_s, 6), "wait_s": round(event.window[r].wait_s, 6)}
                      for r in sorted(event.window)},
        }
        incident = self._open[job] = self._record(Incident(
            id=new_incident_id(now), kind=IncidentKind.COMM_REGRESSION, job=job, node=self._node,
            ranks=tuple(sorted(event.window)), evidence=evidence, detected_at=now, updated_at=now, action="alert",
            outcome="regressed"))
        self._ask_for_link_check(job, incident.id)

    def metrics(self, jobs) -> Iterator[Metric]:
        flag = GaugeMetricFamily("trainwarden_comm_regression", "1 while the job's steps are slower because its "
                                 "collectives are (a communication regression), judged on this node's ranks.",
                                 labels=["job", "node"])
        ratio = GaugeMetricFamily("trainwarden_comm_regression_ratio", "The job's step time in the latest judged "
                                  "window / its baseline (the communication-regression detector's view).",
                                  labels=["job", "node"])
        for job in sorted(jobs):
            flag.add_metric([job, self._node], 1.0 if self.detector.regressed(job) else 0.0)
            last = self.detector.last_window(job)
            if last is not None:
                ratio.add_metric([job, self._node], last["ratio"])
        yield flag
        yield ratio


class _OtherNodes:
    """This node's ``slow_off_links`` beacon and the other nodes' (module docstring); alone while etcd fails."""

    def __init__(self, cluster, clock: Callable[[], float]) -> None:
        self._cluster, self._clock = cluster, clock
        self._failing: dict[str, float] = {}  # job -> when to ask etcd again (its failure said once)

    def share(self, job: str, slow: bool) -> None:
        self._ask(job, lambda: self._cluster.set_slow_off_links(job, slow))

    def slow_elsewhere(self, job: str) -> list[str]:
        return self._ask(job, lambda: self._cluster.slow_off_links_elsewhere(job)) or []

    def forget(self, job: str) -> None:
        self._failing.pop(job, None)
        try:
            self._cluster.set_slow_off_links(job, False)
        except Exception:
            pass  # the beacon's lease ends it

    def _ask(self, job: str, call: Callable[[], object]):
        if self._clock() < self._failing.get(job, float("-inf")):
            return None
        try:
            answer = call()
        except Exception as exc:
            if job not in self._failing:
                log.warning("job %s: cannot compare this node's step times with the other nodes' through etcd "
                            "(%s); judging communication regressions from this node's ranks alone, asking again "
                            "every %.0f s", job, exc, CLUSTER_RETRY_S, extra={"job": job})
            self._failing[job] = self._clock() + CLUSTER_RETRY_S
            return None
        if self._failing.pop(job, None) is not None:
            log.info("job %s: comparing step times with the other nodes again", job, extra={"job": job})
        return answer

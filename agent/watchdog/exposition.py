"""The watchdog's Prometheus series (``Watchdog.collector``), read from what its last check published."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from trainwarden.agent.watchdog.loop import Watchdog

__all__ = ["WatchdogCollector"]


class WatchdogCollector(Collector):
    """The watchdog's series: straggler scores and flags, the hang deadline, seconds since progress, its own errors, the
    straggler incidents it held back, the read pace it asks for, and the communication-regression watch's."""

    def __init__(self, watchdog: "Watchdog") -> None:
        self._w = watchdog

    def collect(self) -> Iterator[Metric]:
        w = self._w
        checks, scores = w.published()
        rank_labels, job_labels = ["job", "node", "rank"], ["job", "node"]
        score = GaugeMetricFamily("trainwarden_straggler_score", "Rank compute share / its peers' median "
                                  "(1 = typical).", labels=rank_labels)
        flag = GaugeMetricFamily("trainwarden_straggler", "1 while the rank is flagged as a straggler.",
                                 labels=rank_labels)
        timeout = GaugeMetricFamily("trainwarden_hang_timeout_seconds", "The job's current hang deadline.",
                                    labels=job_labels)
        stalled = GaugeMetricFamily("trainwarden_seconds_since_progress",
                                    "Seconds since any rank of the job completed a step.", labels=job_labels)
        errors = CounterMetricFamily("trainwarden_watchdog_errors", "Watchdog iterations that failed.",
                                     labels=["node"])
        suppressed = CounterMetricFamily("trainwarden_straggler_incidents_suppressed",
                                         "Straggler flags raised without an incident (one already open for the "
                                         "rank, or the job's hourly limit reached).", labels=job_labels)
        pace = GaugeMetricFamily("trainwarden_flight_recorder_read_pace_seconds",
                                 "The longest Flight Recorder read period the watchdog asks the job's workers for "
                                 "while no detector is near a decision (0: their own pace, 1.5 s by default).",
                                 labels=job_labels)
        for job, seconds in sorted(w.read_pace.items()):
            pace.add_metric([job, w.node], seconds)
        send = GaugeMetricFamily("trainwarden_step_send_pace_seconds",
                                 "How long the watchdog lets the job's workers hold back steps that keep ending "
                                 "while no detector is near a decision (0: they send every 0.5 s).",
                                 labels=job_labels)
        for job, seconds in sorted(w.send_pace.items()):
            send.add_metric([job, w.node], seconds)
        for job, n in sorted(w.suppressed.items()):
            suppressed.add_metric([job, w.node], n)
        for job, ranks in scores.items():
            for rank, s in ranks.items():
                score.add_metric([job, w.node, str(rank)], s.score)
                flag.add_metric([job, w.node, str(rank)], 1.0 if s.flagged else 0.0)
        for job, check in checks.items():
            timeout.add_metric([job, w.node], check.timeout_s)
            stalled.add_metric([job, w.node], check.stalled_s)
        errors.add_metric([w.node], w.errors)
        yield from (score, flag, timeout, stalled, errors, suppressed, pace, send)
        yield from w.comm_metrics(checks)

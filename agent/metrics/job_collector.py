"""Prometheus collector for job telemetry: yields metric families from a `JobTelemetry` at scrape time.

Like prometheus_client's own custom collectors, it holds no metric objects: each scrape takes one
`JobTelemetry.snapshot()` and turns it into families, so the exposition always matches the store and a job
that `JobTelemetry.prune()` forgot disappears from /metrics. Labels are bounded: job, node, rank, op, kind (a
numeric event's, two values) and reason; never step numbers, paths or free text. The exporter (agent/exporter.py) registers this next to
the GPU and host collectors:

    registry.register(JobMetricsCollector(job_telemetry, node=hostname))

Families (all prefixed trainwarden_):

    step_duration_seconds            histogram  job, node, rank
    last_step                        gauge      job, node, rank
    tokens_total                     counter    job, node, rank
    step_seconds_total               counter    job, node, rank
    collective_wait_seconds_total    counter    job, node, rank, op
    compute_seconds_total            counter    job, node, rank   (step seconds minus collective wait)
    collective_last_seq_id           gauge      job, node, rank   (max over the rank's process groups)
    checkpoint_stall_seconds         gauge      job, node, rank   (step blocked by the last checkpoint's staging)
    checkpoint_last_step             gauge      job, node         (newest committed checkpoint)
    checkpoint_failures_total        counter    job, node
    checkpoint_age_seconds           gauge      job, node         (since the newest commit)
    checkpoint_last_commit_time_seconds gauge   job, node
    checkpoints_set_aside_total      counter    job, node         (passed over by a restore)
    numeric_events_total             counter    job, node, kind   (nan, loss_spike: runtime/numeric.py; sdc: runtime/sdc_check.py)
    worker_restarts_total            counter    job, node
    worker_up                        gauge      job, node, rank
    telemetry_dropped_total          counter    job, node, rank   (records the worker dropped)
    telemetry_rejected_total         counter    node, reason      (messages the agent refused)
"""

from __future__ import annotations

import time
from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from trainwarden.agent.shared.contract import NUMERIC_KINDS

from trainwarden.agent.telemetry.job_telemetry import STEP_BUCKETS, JobTelemetry

__all__ = ["JobMetricsCollector"]


class JobMetricsCollector(Collector):
    """Job metric families computed from `job_telemetry` on every scrape."""

    def __init__(self, job_telemetry: JobTelemetry, *, node: str, wall=time.time) -> None:
        if not node:
            raise ValueError("node must be a non-empty name (the host name of this agent)")
        self._job_telemetry = job_telemetry
        self._node = node
        self._wall = wall

    def collect(self) -> Iterator[Metric]:
        ranks, jobs = _RankFamilies(), _JobFamilies()
        node, now = self._node, self._wall()
        for job in self._job_telemetry.snapshot():
            for r in job.ranks:
                ranks.add(job.job, node, r)
            jobs.add(node, job, now)
        rejected = CounterMetricFamily("trainwarden_telemetry_rejected",
                                       "Telemetry messages the agent refused.", labels=["node", "reason"])
        overflow = CounterMetricFamily("trainwarden_telemetry_overflow",
                                       "Telemetry not stored to keep label sets bounded (more process-group/op "
                                       "pairs or ops than a rank may have).", labels=["node", "reason"])
        for reason, count in sorted(self._job_telemetry.rejected().items()):
            rejected.add_metric([node, reason], count)
        for kind, count in sorted(self._job_telemetry.overflow().items()):
            overflow.add_metric([node, kind], count)
        yield from (*ranks.families(), *jobs.families(), rejected, overflow)


_RANK = ["job", "node", "rank"]
_JOB = ["job", "node"]


class _RankFamilies:
    """The per-rank families of one scrape."""

    def __init__(self) -> None:
        self.step = HistogramMetricFamily("trainwarden_step_duration_seconds",
                                          "Training step duration per rank.", labels=_RANK)
        self.last_step = GaugeMetricFamily("trainwarden_last_step", "Index of the rank's last finished step.",
                                           labels=_RANK)
        self.tokens = CounterMetricFamily("trainwarden_tokens", "Tokens processed by the rank.", labels=_RANK)
        self.step_seconds = CounterMetricFamily("trainwarden_step_seconds", "Seconds spent in training steps.",
                                                labels=_RANK)
        self.wait = CounterMetricFamily("trainwarden_collective_wait_seconds",
                                        "Seconds the rank waited in collectives for its peers: on NCCL the measured "
                                        "durations; on gloo the time from its arrival to the last local member's "
                                        "(arrivals matched across the node's ranks; collectives with no other member "
                                        "on the node count no wait).",
                                        labels=_RANK + ["op"])
        self.compute = CounterMetricFamily("trainwarden_compute_seconds",
                                           "Step seconds not spent waiting in collectives.", labels=_RANK)
        self.seq = GaugeMetricFamily("trainwarden_collective_last_seq_id",
                                     "Highest collective sequence id seen in any of the rank's process groups.",
                                     labels=_RANK)
        self.stall = GaugeMetricFamily("trainwarden_checkpoint_stall_seconds",
                                       "Seconds the last checkpoint blocked the training step.", labels=_RANK)
        self.up = GaugeMetricFamily("trainwarden_worker_up", "1 while the rank's telemetry stream is connected.",
                                    labels=_RANK)
        self.dropped = CounterMetricFamily("trainwarden_telemetry_dropped",
                                           "Telemetry records the worker dropped (queue full, agent away).",
                                           labels=_RANK)

    def add(self, job: str, node: str, r) -> None:
        labels = [job, node, str(r.rank)]
        cumulative, buckets = 0, []
        for bound, count in zip(STEP_BUCKETS, r.step_bucket_counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        buckets.append(("+Inf", r.step_count))
        self.step.add_metric(labels, buckets=buckets, sum_value=r.step_seconds_total)
        self.last_step.add_metric(labels, r.last_step)
        self.tokens.add_metric(labels, r.tokens_total)
        self.step_seconds.add_metric(labels, r.step_seconds_total)
        for op, seconds in sorted(r.wait_seconds_by_op.items()):
            self.wait.add_metric(labels + [op], seconds)
        self.compute.add_metric(labels, r.compute_seconds_total)
        if r.collectives:
            self.seq.add_metric(labels, max(c.last_seq_id for c in r.collectives))
        self.stall.add_metric(labels, r.checkpoint_stall_seconds)
        self.up.add_metric(labels, 1.0 if r.connected else 0.0)
        self.dropped.add_metric(labels, r.dropped_total)

    def families(self) -> tuple[Metric, ...]:
        return (self.step, self.last_step, self.tokens, self.step_seconds, self.wait, self.compute, self.seq,
                self.stall, self.up, self.dropped)


class _JobFamilies:
    """The per-job families of one scrape."""

    def __init__(self) -> None:
        self.ckpt_step = GaugeMetricFamily("trainwarden_checkpoint_last_step",
                                           "Step of the newest committed checkpoint.", labels=_JOB)
        self.ckpt_failed = CounterMetricFamily("trainwarden_checkpoint_failures", "Checkpoint saves that failed.",
                                               labels=_JOB)
        self.ckpt_age = GaugeMetricFamily("trainwarden_checkpoint_age_seconds",
                                          "Seconds since the job's newest checkpoint was committed.", labels=_JOB)
        self.ckpt_time = GaugeMetricFamily("trainwarden_checkpoint_last_commit_time_seconds",
                                           "Unix time the job's newest checkpoint was committed.", labels=_JOB)
        self.ckpt_aside = CounterMetricFamily("trainwarden_checkpoints_set_aside",
                                              "Checkpoints a restore passed over: quarantined (unfinished, corrupt, "
                                              "unloadable) or unreadable and left in place.", labels=_JOB)
        self.numeric = CounterMetricFamily("trainwarden_numeric_events", "Steps whose loss or gradients were not "
                                           "finite (kind nan) or whose loss spiked (loss_spike), as the workers' "
                                           "numeric guard reported them, and ranks whose gradient of a shared "
                                           "micro-batch differed from their replicas' (sdc).",
                                           labels=_JOB + ["kind"])
        self.restarts = CounterMetricFamily("trainwarden_worker_restarts", "Worker group restarts of the job.",
                                            labels=_JOB)

    def add(self, node: str, job, now: float) -> None:
        labels = [job.job, node]
        if job.checkpoint_last_step >= 0:
            self.ckpt_step.add_metric(labels, job.checkpoint_last_step)
        self.ckpt_failed.add_metric(labels, job.checkpoint_failures_total)
        self.ckpt_aside.add_metric(labels, job.checkpoint_set_aside_total)
        if job.checkpoint_committed_unix > 0:
            self.ckpt_time.add_metric(labels, job.checkpoint_committed_unix)
            self.ckpt_age.add_metric(labels, max(0.0, now - job.checkpoint_committed_unix))
        self.restarts.add_metric(labels, job.restarts_total)
        seen = dict(job.numeric_events)
        for kind in NUMERIC_KINDS:  # every kind from 0: increase() and alerts see the first event
            self.numeric.add_metric(labels + [kind], seen.get(kind, 0))

    def families(self) -> tuple[Metric, ...]:
        return (self.ckpt_step, self.ckpt_failed, self.ckpt_age, self.ckpt_time, self.ckpt_aside, self.numeric,
                self.restarts)

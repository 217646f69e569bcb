"""The Prometheus side of the agent: the exporter that serves one registry (``exporter``) and the collector
of job telemetry (``job_collector``), and the relay that puts the series of the jobs a node daemon runs on
its own endpoint (``relay``). Other collectors live beside what they measure (health samplers, the
watchdog, incident counters) and are registered here by the node.

It imports ``telemetry`` and the top-level package (the version).
"""

from trainwarden.agent.metrics.exporter import DEFAULT_METRICS_PORT, ExporterError, MetricsExporter, build_registry
from trainwarden.agent.metrics.job_collector import JobMetricsCollector
from trainwarden.agent.metrics.relay import LauncherRelay

__all__ = ["DEFAULT_METRICS_PORT", "ExporterError", "JobMetricsCollector", "LauncherRelay", "MetricsExporter",
           "build_registry"]

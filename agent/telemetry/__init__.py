"""Telemetry ingest: the gRPC server workers stream to (``server``), the per-job, per-rank state it feeds
(``job_telemetry``) and the matching of collective arrivals across a node's ranks (``arrivals``).

Readers (metrics, the watchdog, ``status``) work on ``JobTelemetry.snapshot()``. It imports ``proto`` only.
"""

from trainwarden.agent.telemetry.job_telemetry import JobSnapshot, JobTelemetry, RankSnapshot, WorkerInfo
from trainwarden.agent.telemetry.server import TelemetryServer, TelemetryServerError

__all__ = ["JobSnapshot", "JobTelemetry", "RankSnapshot", "TelemetryServer", "TelemetryServerError", "WorkerInfo"]

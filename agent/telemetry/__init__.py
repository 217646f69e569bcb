"""Telemetry ingest: the gRPC server workers stream to (``server``), the per-job, per-rank state it feeds
(``job_telemetry``), the matching of collective arrivals across a node's ranks (``arrivals``) and the
agent's health on a TCP port for probes (``health_endpoint``).

Readers (metrics, the watchdog, ``status``) work on ``JobTelemetry.snapshot()``. It imports ``shared`` only.
"""

from trainwarden.agent.telemetry.health_endpoint import HealthEndpoint, HealthEndpointError
from trainwarden.agent.telemetry.job_telemetry import JobSnapshot, JobTelemetry, RankSnapshot, WorkerInfo
from trainwarden.agent.telemetry.server import TelemetryServer, TelemetryServerError

__all__ = ["HealthEndpoint", "HealthEndpointError", "JobSnapshot", "JobTelemetry", "RankSnapshot", "TelemetryServer",
           "TelemetryServerError", "WorkerInfo"]

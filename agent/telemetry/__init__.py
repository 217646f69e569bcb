"""Telemetry ingest: the gRPC server workers stream to (``server``; its parts: ``socket_file``, ``records`` that turn
a stream's messages into the store's calls, ``replies`` of the reading RPCs, ``commit_check``), the per-job,
per-rank state it feeds (``job_telemetry``, the store; ``rank_state`` behind it; ``snapshots``, what readers get),
the matching of collective arrivals across a node's ranks (``arrivals``) and the agent's health on a TCP port for
probes (``health_endpoint``).

Readers (metrics, the watchdog, ``status``) work on ``JobTelemetry.snapshot()``. It imports ``shared`` only.
"""

from trainwarden.agent.telemetry.health_endpoint import HealthEndpoint, HealthEndpointError
from trainwarden.agent.telemetry.job_telemetry import JobSnapshot, JobTelemetry, RankSnapshot, WorkerInfo
from trainwarden.agent.telemetry.server import TelemetryServer, TelemetryServerError

__all__ = ["HealthEndpoint", "HealthEndpointError", "JobSnapshot", "JobTelemetry", "RankSnapshot", "TelemetryServer",
           "TelemetryServerError", "WorkerInfo"]

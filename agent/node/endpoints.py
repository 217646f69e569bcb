"""Where a node agent serves and how to ask it: its socket, its metrics URL, its health, its status.

A node has one agent: the daemon (``trainwarden agent``, socket ``DEFAULT_SOCKET``) or the in-process agent of
a ``trainwarden run``. Workers find it through ``TRAINWARDEN_AGENT_SOCKET``; a ``trainwarden run`` also records
its socket and metrics URL in the job's state directory (``AGENT_SOCKET_RECORD``, ``AGENT_METRICS_RECORD``) so
that ``status``/``top --job`` find the agent of that run, whatever port it got. ``check_agent`` asks the
standard gRPC health service (the daemon's ``--check``, Kubernetes probes; ``health_status`` is its bare answer,
which the daemon's own liveness asks too); ``fetch_status`` the unary ``Status`` RPC (``status`` and ``top``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from trainwarden.agent.common.paths import job_state_dir
from trainwarden.agent.common.untrusted_fs import read_small_text
from trainwarden.agent.shared import telemetry_pb2 as pb
from trainwarden.agent.shared.contract import AGENT_SOCKET_ENV as SOCKET_ENV, SERVICE_NAME, STATUS_METHOD
from trainwarden.agent.shared.peer_token import token_metadata

__all__ = [
    "AGENT_METRICS_RECORD", "AGENT_SOCKET_RECORD", "DEFAULT_METRICS_URL", "DEFAULT_SOCKET", "SOCKET_ENV",
    "AgentUnavailable", "check_agent", "fetch_status", "health_status", "recorded_metrics_url", "resolve_metrics_url", "resolve_socket",
]

DEFAULT_SOCKET = Path("/run/trainwarden/agent.sock")
"""Where `trainwarden agent` (the daemon) listens unless told otherwise."""
AGENT_SOCKET_RECORD = "agent.sock.path"
"""File in a job's state directory holding the socket of the `trainwarden run` serving it."""
AGENT_METRICS_RECORD = "agent.metrics.url"
"""File in a job's state directory holding the metrics URL of the `trainwarden run` serving it."""
DEFAULT_METRICS_URL = "http://127.0.0.1:9478/metrics"
"""The agent's Prometheus endpoint on this node (`top` reads GPU gauges from it)."""



class AgentUnavailable(Exception):
    """No agent answers on the socket. Retrying helps once one is started there."""


def resolve_socket(explicit: str | os.PathLike | None = None, job: str | None = None, *,
                   env: Mapping[str, str] = os.environ, state_home: str | os.PathLike | None = None) -> Path:
    """The agent socket to ask, in the order described in the module docstring."""
    if explicit:
        return Path(explicit)
    if env.get(SOCKET_ENV):
        return Path(env[SOCKET_ENV])
    if job:
        state = job_state_dir(job, state_home)
        try:  # the job's user writes it, root may read it: no link followed, no FIFO, a bound (untrusted_fs)
            recorded = read_small_text(state / AGENT_SOCKET_RECORD, 4096, under=state.parent).strip()
        except OSError:
            recorded = ""
        if recorded and os.path.exists(recorded):
            return Path(recorded)
    return DEFAULT_SOCKET


def resolve_metrics_url(explicit: str | None = None, job: str | None = None, *,
                        state_home: str | os.PathLike | None = None) -> str | None:
    """The Prometheus endpoint `top` reads GPU gauges from: --metrics-url ("none": none), else the one a
    running `trainwarden run` of --job recorded, else the daemon's default."""
    if explicit:
        return None if explicit == "none" else explicit
    return (recorded_metrics_url(job, state_home=state_home) if job else None) or DEFAULT_METRICS_URL


def recorded_metrics_url(job: str, *, state_home: str | os.PathLike | None = None) -> str | None:
    """The metrics URL the running `trainwarden run` of ``job`` recorded in its state directory, or None. The
    file is the job user's: read without following a link or blocking on a FIFO, and only a launcher's own
    ``http://127.0.0.1:PORT/metrics`` is returned (agent/metrics/launcher_fetch.py), so root's `top --job J`
    fetches nothing else a job names."""
    from trainwarden.agent.metrics.launcher_fetch import TargetRefused, launcher_target, read_record

    try:
        url = read_record(job_state_dir(job, state_home), AGENT_METRICS_RECORD)
        if url:
            launcher_target(url)
        return url or None
    except (TargetRefused, OSError, ValueError):
        return None


def _unavailable(socket_path: Path, why: str = "") -> AgentUnavailable:
    detail = f" ({why})" if why else ""
    return AgentUnavailable(f"no agent at unix:{socket_path}{detail}: start `trainwarden agent` or pass --socket")


def fetch_status(socket_path: str | os.PathLike, job: str | None = None, *, timeout: float = 5.0) -> pb.StatusReply:
    """One `Status` call; `AgentUnavailable` if nothing answers on the socket."""
    import grpc

    path = Path(socket_path)
    if not path.exists():
        raise _unavailable(path)
    with grpc.insecure_channel(f"unix:{path}") as channel:
        call = channel.unary_unary(STATUS_METHOD, request_serializer=pb.StatusRequest.SerializeToString,
                                   response_deserializer=pb.StatusReply.FromString)
        try:
            # the agent shows a caller only the jobs of its own uid (root and the agent's user: every job), which
            # it learns from this token
            return call(pb.StatusRequest(job=job or ""), timeout=timeout, wait_for_ready=False,
                        metadata=token_metadata(str(path)))
        except grpc.RpcError as exc:
            raise _unavailable(path, exc.code().name.lower()) from exc


def health_status(socket_path: str | os.PathLike, *, timeout: float = 3.0) -> str:
    """What the agent's gRPC health service on ``socket_path`` answers: ``SERVING`` or another status name
    (``NOT_SERVING`` while it stops); or why nothing answered: ``no socket``, or the call's status code in lower
    case (``unavailable``, ``deadline_exceeded``)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    path = Path(socket_path)
    if not path.exists():
        return "no socket"
    with grpc.insecure_channel(f"unix:{path}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code().name.lower()
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def check_agent(socket_path: str | os.PathLike, *, timeout: float = 3.0) -> str | None:
    """Ask the agent's gRPC health service; None when it is SERVING, else what is wrong (for probes)."""
    path = Path(socket_path)
    status = health_status(path, timeout=timeout)
    if status == "SERVING":
        return None
    if status == "no socket":
        return str(_unavailable(path))
    if status.islower():  # no answer: the call's status code
        return str(_unavailable(path, status))
    return f"agent at unix:{path} is {status}"

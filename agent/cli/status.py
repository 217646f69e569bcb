"""`trainwarden status` and `trainwarden top`: the node's jobs and ranks, read from the agent over gRPC.

Both ask the agent's unary ``Status`` RPC (agent/telemetry.py) on its unix socket; nothing is read from
etcd or from disk, so they show what the agent sees now. Which agent: ``--socket``, else
``$TRAINWARDEN_AGENT_SOCKET``, else, with ``--job``, the socket that a running ``trainwarden run`` of that job
recorded in its state directory (``<state_dir>/agent.sock.path``; a job started by ``trainwarden run`` only
reports to that run's in-process agent), else the daemon's ``/run/trainwarden/agent.sock``.

``status`` prints one table per job (or ``--json``). ``top`` redraws a frame every ``--interval`` seconds
(ANSI home + clear on a terminal; one frame after another otherwise, ``--iterations`` to stop) and adds
each rank's GPU utilization and temperature, taken from the agent's Prometheus endpoint
(``trainwarden_gpu_*{gpu=<local rank>}``: the usual one-GPU-per-local-rank layout); "-" where there is no
GPU or no endpoint. An unreachable agent is one line on stderr and ``EXIT_AGENT_UNAVAILABLE``.

The argument parsing lives in agent/cli.py; the functions here return exit codes and take their outside
world (environment, clock, sleep, the metrics fetch) as parameters.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Callable, Mapping, TextIO

from trainwarden.agent.common import exit_codes
from trainwarden.agent.common.paths import job_state_dir
from trainwarden.agent.proto import telemetry_pb2 as pb

__all__ = [
    "AGENT_SOCKET_RECORD", "DEFAULT_METRICS_URL", "DEFAULT_SOCKET", "SOCKET_ENV", "AgentUnavailable",
    "check_agent", "fetch_gpu_stats", "fetch_status", "format_status", "format_top", "parse_gpu_stats",
    "resolve_socket",
    "status_command", "status_to_json", "top_command",
]

DEFAULT_SOCKET = Path("/run/trainwarden/agent.sock")
"""Where `trainwarden agent` (the daemon) listens unless told otherwise."""
SOCKET_ENV = "TRAINWARDEN_AGENT_SOCKET"
"""The environment variable workers, `status` and `top` read the agent's socket from."""
AGENT_SOCKET_RECORD = "agent.sock.path"
"""File in a job's state directory holding the socket of the `trainwarden run` serving it."""
AGENT_METRICS_RECORD = "agent.metrics.url"
"""File in a job's state directory holding the metrics URL of the `trainwarden run` serving it."""
DEFAULT_METRICS_URL = "http://127.0.0.1:9478/metrics"
"""The agent's Prometheus endpoint on this node (`top` reads GPU gauges from it)."""

_SERVICE = "trainwarden.v1.Telemetry"
_CLEAR = "\x1b[H\x1b[2J"


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
        record = job_state_dir(job, state_home) / AGENT_SOCKET_RECORD
        try:
            recorded = record.read_text().strip()
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
    if job:
        try:
            recorded = (job_state_dir(job, state_home) / AGENT_METRICS_RECORD).read_text().strip()
        except (OSError, ValueError):
            recorded = ""
        if recorded:
            return recorded
    return DEFAULT_METRICS_URL


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
        call = channel.unary_unary(f"/{_SERVICE}/Status", request_serializer=pb.StatusRequest.SerializeToString,
                                   response_deserializer=pb.StatusReply.FromString)
        try:
            return call(pb.StatusRequest(job=job or ""), timeout=timeout, wait_for_ready=False)
        except grpc.RpcError as exc:
            raise _unavailable(path, exc.code().name.lower()) from exc


def check_agent(socket_path: str | os.PathLike, *, timeout: float = 3.0) -> str | None:
    """Ask the agent's gRPC health service; None when it is SERVING, else what is wrong (for probes)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    path = Path(socket_path)
    if not path.exists():
        return str(_unavailable(path))
    with grpc.insecure_channel(f"unix:{path}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=_SERVICE), timeout=timeout)
        except grpc.RpcError as exc:
            return str(_unavailable(path, exc.code().name.lower()))
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"agent at unix:{path} is {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return None


# ---- formatting ---------------------------------------------------------------------------------------

def _seconds(value: float) -> str:
    return f"{value:.3f}s" if value > 0 else "-"


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value > 0 else "-"


def _step(value: int) -> str:
    return str(value) if value >= 0 else "-"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]


def _job_line(job: pb.JobStatus) -> str:
    mesh = ",".join(f"{k}={v}" for k, v in sorted(job.mesh.items())) or "-"
    ckpt = _step(job.checkpoint_last_step) if job.checkpoint_last_step >= 0 else "none"
    connected = sum(r.connected for r in job.ranks)
    return (f"job {job.job}  {connected}/{len(job.ranks)} ranks connected  world {job.world_size or '-'}  "
            f"mesh {mesh}  "
            f"step {_step(job.last_step)}  p50 {_seconds(job.step_p50_seconds)}  p99 {_seconds(job.step_p99_seconds)}"
            f"  tokens/s {_rate(job.tokens_per_second)}  checkpoint {ckpt}  flags {','.join(job.flags) or '-'}")


_STATUS_COLUMNS = ("RANK", "PID", "CONNECTED", "STEP", "SEEN", "P50", "P99", "WAIT", "TOKENS/S", "SCORE",
                   "RESTARTS", "FLAGS")


def format_status(reply: pb.StatusReply) -> str:
    """The `status` table: a line per job, then a row per rank."""
    if not reply.jobs:
        return f"node {reply.node}: no jobs reporting to this agent"
    lines = [f"node {reply.node}"]
    for job in reply.jobs:
        rows = [(str(r.rank), str(r.pid or "-"), "yes" if r.connected else "no", _step(r.last_step),
                 f"{r.last_seen_seconds_ago:.1f}s ago", _seconds(r.step_p50_seconds), _seconds(r.step_p99_seconds),
                 f"{r.wait_share:.0%}", _rate(r.tokens_per_second), _score(r.straggler_score), str(r.restart_count),
                 ",".join(r.flags) or "-")
                for r in sorted(job.ranks, key=lambda r: r.rank)]
        lines += ["", _job_line(job), *_table(_STATUS_COLUMNS, rows)]
    return "\n".join(lines)


def _score(score: float) -> str:
    return f"{score:.2f}" if score > 0 else "-"


def _rank_json(r: pb.RankStatus) -> dict:
    return {"rank": r.rank, "local_rank": r.local_rank, "pid": r.pid, "hostname": r.hostname,
            "connected": r.connected, "last_step": r.last_step if r.last_step >= 0 else None,
            "last_seen_seconds_ago": r.last_seen_seconds_ago, "step_p50_seconds": r.step_p50_seconds,
            "step_p99_seconds": r.step_p99_seconds, "wait_share": r.wait_share,
            "tokens_per_second": r.tokens_per_second, "restart_count": r.restart_count, "flags": list(r.flags),
            "straggler_score": r.straggler_score or None}


def status_to_json(reply: pb.StatusReply) -> dict:
    """The reply as plain JSON types (int64 stay numbers; "no step yet" is null)."""
    return {"node": reply.node, "jobs": [
        {"job": j.job, "world_size": j.world_size, "mesh": dict(j.mesh),
         "last_step": j.last_step if j.last_step >= 0 else None,
         "step_p50_seconds": j.step_p50_seconds, "step_p99_seconds": j.step_p99_seconds,
         "tokens_per_second": j.tokens_per_second,
         "checkpoint_last_step": j.checkpoint_last_step if j.checkpoint_last_step >= 0 else None,
         "flags": list(j.flags), "ranks": [_rank_json(r) for r in sorted(j.ranks, key=lambda r: r.rank)]}
        for j in reply.jobs]}


GpuStats = dict[int, tuple[float | None, float | None]]
"""GPU index -> (utilization ratio, temperature in °C)."""

_TOP_COLUMNS = ("RANK", "STEP", "P50", "P99", "WAIT", "TOKENS/S", "SCORE", "GPU%", "TEMP", "FLAGS")


def format_top(reply: pb.StatusReply, gpus: GpuStats, *, now: str = "", note: str = "") -> str:
    """One `top` frame: per rank step, step times, wait share, throughput, GPU utilization and temperature."""
    lines = [f"trainwarden top — node {reply.node}{'  ' + now if now else ''}"]
    if note:
        lines.append(note)
    if not reply.jobs:
        lines.append("no jobs reporting to this agent")
    for job in reply.jobs:
        rows = []
        for r in sorted(job.ranks, key=lambda r: r.rank):
            util, temp = gpus.get(r.local_rank, (None, None))
            rows.append((str(r.rank), _step(r.last_step), _seconds(r.step_p50_seconds), _seconds(r.step_p99_seconds),
                         f"{r.wait_share:.0%}", _rate(r.tokens_per_second), _score(r.straggler_score),
                         f"{util:.0%}" if util is not None else "-", f"{temp:.0f}C" if temp is not None else "-",
                         ",".join(r.flags) or ("-" if r.connected else "disconnected")))
        lines += ["", _job_line(job), *_table(_TOP_COLUMNS, rows)]
    return "\n".join(lines)


def fetch_gpu_stats(url: str, *, timeout: float = 2.0) -> GpuStats:
    """GPU utilization and temperature per GPU index from the agent's metrics; empty if unreachable."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read().decode("utf-8", errors="replace")
    except (OSError, ValueError):
        return {}
    return parse_gpu_stats(text)


def parse_gpu_stats(text: str) -> GpuStats:
    """GPU utilization and temperature per GPU index from a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    util: dict[int, float] = {}
    temp: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        target = {"trainwarden_gpu_utilization_ratio": util, "trainwarden_gpu_temperature_celsius": temp}.get(
            family.name)
        if target is None:
            continue
        for sample in family.samples:
            if sample.labels.get("gpu", "").isdigit():
                target[int(sample.labels["gpu"])] = sample.value
    return {gpu: (util.get(gpu), temp.get(gpu)) for gpu in util.keys() | temp.keys()}


# ---- commands -----------------------------------------------------------------------------------------

def status_command(out: TextIO, err: TextIO, socket_path: Path, *, job: str | None = None,
                   as_json: bool = False, fetch: Callable[..., pb.StatusReply] = fetch_status) -> int:
    """`trainwarden status`: print the reply once."""
    try:
        reply = fetch(socket_path, job)
    except AgentUnavailable as exc:
        err.write(f"trainwarden: {exc}\n")
        return exit_codes.EXIT_AGENT_UNAVAILABLE
    if as_json:
        json.dump(status_to_json(reply), out, indent=1, sort_keys=True)
        out.write("\n")
    elif job and not reply.jobs:
        out.write(f"node {reply.node}: job {job} is not reporting to the agent at unix:{socket_path}\n")
    else:
        out.write(format_status(reply) + "\n")
    return exit_codes.EXIT_OK


def top_command(out: TextIO, err: TextIO, socket_path: Path, *, job: str | None = None, interval: float = 2.0,
                iterations: int | None = None, metrics_url: str | None = DEFAULT_METRICS_URL,
                tty: bool | None = None, fetch: Callable[..., pb.StatusReply] = fetch_status,
                gpu_stats: Callable[[str], GpuStats] = fetch_gpu_stats,
                sleep: Callable[[float], None] = time.sleep) -> int:
    """`trainwarden top`: a frame every `interval` seconds until Ctrl-C or `iterations` frames."""
    tty = out.isatty() if tty is None else tty
    frames = 0
    try:
        while iterations is None or frames < iterations:
            started = time.monotonic()
            note = ""
            try:
                reply = fetch(socket_path, job)
            except AgentUnavailable as exc:
                if frames == 0:
                    err.write(f"trainwarden: {exc}\n")
                    return exit_codes.EXIT_AGENT_UNAVAILABLE
                reply, note = pb.StatusReply(node=reply.node), f"agent unreachable, retrying: {exc}"
            gpus = gpu_stats(metrics_url) if metrics_url else {}
            frame = format_top(reply, gpus, now=time.strftime("%H:%M:%S"), note=note)
            out.write((_CLEAR + frame + "\n") if tty else (frame + "\n\n"))
            out.flush()
            frames += 1
            if iterations is None or frames < iterations:
                sleep(max(0.0, interval - (time.monotonic() - started)))
    except KeyboardInterrupt:
        out.write("\n")
    return exit_codes.EXIT_OK

"""`trainwarden status` and `trainwarden top`: the node's jobs and ranks, read from the agent over gRPC.

Both ask the agent's unary ``Status`` RPC (agent/telemetry/server.py) on its unix socket; nothing is read
from etcd or from disk, so they show what the agent sees now. Which agent is found as
agent/node/endpoints.py describes (``--socket``, the environment, the record of a running ``trainwarden run``
of ``--job``, else the daemon's socket).

``status`` prints one table per job (or ``--json``). ``top`` redraws a frame every ``--interval`` seconds
(ANSI home + clear on a terminal; one frame after another otherwise, ``--iterations`` to stop) and adds
each rank's GPU utilization and temperature, taken from the agent's Prometheus endpoint
(``trainwarden_gpu_*{gpu=<local rank>}``: the usual one-GPU-per-local-rank layout); "-" where there is no
GPU or no endpoint. An unreachable agent is one line on stderr and ``EXIT_AGENT_UNAVAILABLE``.

The argument parsing lives in agent/cli/main.py; the functions here return exit codes and take their outside
world (environment, clock, sleep, the metrics fetch) as parameters.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable, TextIO

from trainwarden.agent.cli.args import add_etcd_security, job_name, positive_float, positive_int
from trainwarden.agent.common import exit_codes
from trainwarden.agent.common.paths import job_state_dir
from trainwarden.agent.node.endpoints import (DEFAULT_METRICS_URL, AgentUnavailable, fetch_status, resolve_metrics_url,
                                             resolve_socket)
from trainwarden.agent.shared import telemetry_pb2 as pb

__all__ = ["add_parser", "fetch_gpu_stats", "format_status", "format_top", "parse_gpu_stats", "status_command", "status_to_json",
           "top_command"]

_CLEAR = "\x1b[H\x1b[2J"


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
            f"  {_throughput(job)}  checkpoint {ckpt}  flags {','.join(job.flags) or '-'}"
            + (f"  steps from {job.steps_from}" if job.steps_from else ""))


def _throughput(job: pb.JobStatus) -> str:
    """Tokens/s where the job reports tokens; steps/s otherwise (an auto-instrumented script not told
    --tokens-per-step)."""
    if job.tokens_per_second > 0 or job.step_p50_seconds <= 0:
        return f"tokens/s {_rate(job.tokens_per_second)}"
    return f"steps/s {1.0 / job.step_p50_seconds:.2f}"


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


# ---- the command line ----------------------------------------------------------------------------------

def add_parser(sub) -> None:
    where = ("agent socket (default: $TRAINWARDEN_AGENT_SOCKET, else the socket recorded by a running "
             "`trainwarden run` of --job, else /run/trainwarden/agent.sock)")
    p = sub.add_parser("status", help="the node's jobs and ranks, once, from the node agent",
                       description="Print the jobs and ranks the node agent sees: step, step-time p50/p99, "
                                   "collective wait share, tokens/s, restarts and flags per rank.")
    p.add_argument("--socket", metavar="PATH", help=where)
    p.add_argument("--job", type=job_name, metavar="NAME", help="only this job")
    p.add_argument("--state-home", metavar="DIR", help="root of job state directories (to find --job's run)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--etcd", metavar="URL", help="cluster-wide instead, from this etcd: every job (or --job) with "
                   "each node's ranks, their last step and stream state (read-only access is enough)")
    add_etcd_security(p)
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("top", help="live per-rank view of the node's jobs (Ctrl-C to leave)",
                       description="Redraw per-rank progress, step times, wait share, throughput and GPU "
                                   "utilization/temperature every --interval seconds.")
    p.add_argument("--socket", metavar="PATH", help=where)
    p.add_argument("--job", type=job_name, metavar="NAME", help="only this job")
    p.add_argument("--state-home", metavar="DIR", help="root of job state directories (to find --job's run)")
    p.add_argument("--interval", type=positive_float, default=2.0, metavar="S",
                   help="seconds between frames (default 2)")
    p.add_argument("--iterations", type=positive_int, metavar="N", help="stop after N frames (default: until Ctrl-C)")
    p.add_argument("--metrics-url", default=None, metavar="URL",
                   help="the agent's Prometheus endpoint, for GPU gauges (default: the one --job's run recorded, "
                        "else http://127.0.0.1:9478/metrics; "
                        "'none' to skip)")
    p.set_defaults(func=_cmd_top)


def _socket(args):
    return resolve_socket(args.socket, args.job, state_home=args.state_home)


def _cmd_status(args) -> int:
    if args.etcd:
        from trainwarden.agent.cli.jobs import cluster_status

        return cluster_status(args)
    rc = status_command(sys.stdout, sys.stderr, _socket(args), job=args.job, as_json=args.json)
    if args.job and not args.json:
        line = goodput_line(job_state_dir(args.job, args.state_home) / "history" / "goodput.json")
        if line:
            print(line)
    return rc


def goodput_line(path: Path) -> str | None:
    """``goodput 91.2% of 65.3s (...)`` from the ledger a run of the job keeps in its state directory."""
    from trainwarden.agent.common.untrusted_fs import read_small_text  # the job's file; root may be the reader
    from trainwarden.agent.launch.goodput import Goodput

    try:
        return "goodput " + Goodput.from_json(json.loads(read_small_text(path, 1 << 20, under=path.parent.parent))).describe()
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"goodput unknown: {path} cannot be read ({exc})"


def _cmd_top(args) -> int:
    url = resolve_metrics_url(args.metrics_url, args.job, state_home=args.state_home)
    return top_command(sys.stdout, sys.stderr, _socket(args), job=args.job, interval=args.interval,
                       iterations=args.iterations, metrics_url=url)

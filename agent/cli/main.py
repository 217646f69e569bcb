"""The `trainwarden` command line: one entry point, one small function per subcommand.

Argument parsing stays here; each subcommand's work lives in the module named for it
(`run` in agent/run.py, `status` and `top` in agent/status_cli.py, `incidents` in agent/incidents_cli.py,
`agent` in agent/daemon.py). Errors in the input print one line that says what to do and exit
with ``EXIT_USAGE``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from trainwarden.agent import __version__
from trainwarden.agent.common import exit_codes

__all__ = ["main"]

RUN_EXAMPLE = """\
example:
  trainwarden run --nproc-per-node 8 --max-restarts 2 --job demo -- \\
      -m trainwarden.runtime.examples.gpt --dp 2 --tp 2 --pp 2 --steps 60 --ckpt-every 10

With no --etcd, an embedded etcd is started on a free loopback port and stopped on exit.
Job state (logs, checkpoints unless --ckpt-dir is given, fault markers) goes to
$TRAINWARDEN_STATE_HOME/jobs/JOB (default ~/.local/state/trainwarden/jobs/JOB).
Faults for testing: TRAINWARDEN_FAULTS='crash:rank=3,step=12' (see trainwarden.runtime.faults).
"""


def _add_run(sub) -> None:
    p = sub.add_parser(
        "run", help="run a training script under trainwarden on this node (embedded etcd by default)",
        description="Run SCRIPT (or -m MODULE) with torchrun under trainwarden: etcd3 rendezvous, "
                    "restarts, fault recovery, a summary at the end.",
        epilog=RUN_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="N", help="workers on this node (default 1)")
    p.add_argument("--nnodes", default="1", metavar="MIN:MAX", help="nodes, N or MIN:MAX (default 1)")
    p.add_argument("--etcd", metavar="URL", help="use this etcd (host:port or http://host:port) "
                   "instead of starting an embedded one")
    p.add_argument("--max-restarts", type=int, default=3, metavar="K",
                   help="worker-group restarts before the job fails (default 3)")
    p.add_argument("--job", metavar="NAME", help="job name (default: run-<time>)")
    p.add_argument("--state-home", metavar="DIR", help="root of job state directories "
                   "(default $TRAINWARDEN_STATE_HOME or ~/.local/state/trainwarden)")
    p.add_argument("--local-addr", metavar="ADDR", help="address this node advertises to its peers "
                   "(default: 127.0.0.1 for a one-node job, the host name otherwise)")
    p.add_argument("--metrics-port", type=int, default=9478, metavar="PORT",
                   help="port of the in-process agent's Prometheus endpoint on --metrics-host (default 9478; 0: any free port)")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="ADDR",
                   help="address of the Prometheus endpoint (default 127.0.0.1)")
    p.add_argument("--no-agent", action="store_true",
                   help="run without the in-process agent (no telemetry, metrics or watchdog)")
    p.add_argument("--monitor-interval", type=float, default=1.0, metavar="S",
                   help="seconds between torchrun's checks of its workers (default 1)")
    p.add_argument("--straggler-policy", choices=["alert", "exclude"], default="alert",
                   help="on a straggler: alert (flag, metric, incident; default) or exclude (also ask for this "
                        "node's exclusion at the job's next rendezvous: jobs/<job>/exclude/<node>)")
    p.add_argument("script", nargs=argparse.REMAINDER, metavar="-- SCRIPT ARGS...",
                   help="the training script and its arguments, or -m MODULE ARGS...")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args) -> int:
    from trainwarden.agent.launch.run import RunOptions, run

    script = list(args.script)
    if script and script[0] == "--":
        script = script[1:]
    if not script:
        print("trainwarden run: nothing to run; put the script after the options, e.g. "
              "`trainwarden run --nproc-per-node 2 -- train.py --lr 0.1`", file=sys.stderr)
        return exit_codes.EXIT_USAGE
    job = args.job or time.strftime("run-%Y%m%d-%H%M%S")
    try:
        opts = RunOptions(script=script, job=job, nproc_per_node=args.nproc_per_node, nnodes=args.nnodes,
                          etcd=args.etcd, max_restarts=args.max_restarts,
                          monitor_interval=args.monitor_interval,
                          state_home=args.state_home, local_addr=args.local_addr, agent=not args.no_agent,
                          metrics_host=args.metrics_host, metrics_port=args.metrics_port,
                          straggler_policy=args.straggler_policy)
    except ValueError as exc:
        print(f"trainwarden run: {exc}", file=sys.stderr)
        return exit_codes.EXIT_USAGE
    return run(opts)


def _add_status_and_top(sub) -> None:
    where = ("agent socket (default: $TRAINWARDEN_AGENT_SOCKET, else the socket recorded by a running "
             "`trainwarden run` of --job, else /run/trainwarden/agent.sock)")
    p = sub.add_parser("status", help="the node's jobs and ranks, once, from the node agent",
                       description="Print the jobs and ranks the node agent sees: step, step-time p50/p99, "
                                   "collective wait share, tokens/s, restarts and flags per rank.")
    p.add_argument("--socket", metavar="PATH", help=where)
    p.add_argument("--job", metavar="NAME", help="only this job")
    p.add_argument("--state-home", metavar="DIR", help="root of job state directories (to find --job's run)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("top", help="live per-rank view of the node's jobs (Ctrl-C to leave)",
                       description="Redraw per-rank progress, step times, wait share, throughput and GPU "
                                   "utilization/temperature every --interval seconds.")
    p.add_argument("--socket", metavar="PATH", help=where)
    p.add_argument("--job", metavar="NAME", help="only this job")
    p.add_argument("--state-home", metavar="DIR", help="root of job state directories (to find --job's run)")
    p.add_argument("--interval", type=_positive_float, default=2.0, metavar="S",
                   help="seconds between frames (default 2)")
    p.add_argument("--iterations", type=_positive_int, metavar="N", help="stop after N frames (default: until Ctrl-C)")
    p.add_argument("--metrics-url", default=None, metavar="URL",
                   help="the agent's Prometheus endpoint, for GPU gauges (default: the one --job's run recorded, "
                        "else http://127.0.0.1:9478/metrics; "
                        "'none' to skip)")
    p.set_defaults(func=_cmd_top)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _socket(args):
    from trainwarden.agent.cli.status import resolve_socket

    return resolve_socket(args.socket, args.job, state_home=args.state_home)


def _cmd_status(args) -> int:
    from trainwarden.agent.cli.status import status_command

    return status_command(sys.stdout, sys.stderr, _socket(args), job=args.job, as_json=args.json)


def _cmd_top(args) -> int:
    from trainwarden.agent.cli.status import resolve_metrics_url, top_command

    url = resolve_metrics_url(args.metrics_url, args.job, state_home=args.state_home)
    return top_command(sys.stdout, sys.stderr, _socket(args), job=args.job, interval=args.interval,
                       iterations=args.iterations, metrics_url=url)


def _add_incidents(sub) -> None:
    p = sub.add_parser("incidents", help="hangs, stragglers and failures recorded on this node",
                       description="List recorded incidents (oldest first), or `incidents show ID` for one.")
    p.add_argument("--job", metavar="NAME", help="only this job's incidents")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--state-home", metavar="DIR", help="root of job state directories "
                   "(default $TRAINWARDEN_STATE_HOME or ~/.local/state/trainwarden)")
    p.set_defaults(func=_cmd_incidents)
    actions = p.add_subparsers(dest="incidents_action", metavar="show ID")
    show = actions.add_parser("show", help="one incident in full: verdict, stacks, action, outcome")
    show.add_argument("id", metavar="ID", help="incident id or a unique prefix of it")
    # SUPPRESS: `incidents --json show ID` keeps the --json given before `show`
    show.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON instead of a report")
    show.add_argument("--state-home", metavar="DIR", default=argparse.SUPPRESS, help="root of job state directories")
    show.set_defaults(func=_cmd_incidents_show)


def _cmd_incidents(args) -> int:
    from trainwarden.agent.cli.incidents import incidents_list
    from trainwarden.agent.common.paths import validate_job_name

    if args.job:
        try:
            validate_job_name(args.job)
        except ValueError as exc:
            print(f"trainwarden incidents: {exc}", file=sys.stderr)
            return exit_codes.EXIT_USAGE
    return incidents_list(sys.stdout, root=args.state_home, job=args.job, as_json=args.json)


def _cmd_incidents_show(args) -> int:
    from trainwarden.agent.cli.incidents import incidents_show

    return incidents_show(sys.stdout, args.id, root=args.state_home, as_json=args.json, err=sys.stderr)


def _add_agent(sub) -> None:
    from trainwarden.agent.cli.status import DEFAULT_SOCKET

    p = sub.add_parser("agent", help="run the node agent daemon (telemetry socket, metrics, watchdog)",
                       description="Run the node agent until SIGTERM/SIGINT: workers stream telemetry to --socket, "
                                   "Prometheus scrapes --metrics-host:--metrics-port, the watchdog handles hangs.")
    p.add_argument("--socket", default=str(DEFAULT_SOCKET), metavar="PATH",
                   help=f"telemetry unix socket (default {DEFAULT_SOCKET})")
    p.add_argument("--metrics-host", default="0.0.0.0", metavar="ADDR",
                   help="address of the Prometheus endpoint (default 0.0.0.0)")
    p.add_argument("--metrics-port", type=int, default=9478, metavar="PORT",
                   help="port of the Prometheus endpoint (default 9478; 0: any free port)")
    p.add_argument("--node", metavar="NAME", help="this node's name in metrics and incidents (default: host name)")
    p.add_argument("--state-home", metavar="DIR", help="root of job state directories (incidents, diagnostics)")
    p.add_argument("--etcd", metavar="HOST:PORT", help="also record incidents in this etcd")
    p.add_argument("--straggler-policy", choices=["alert", "exclude"], default="alert",
                   help="on a straggler: alert (default) or exclude (also ask for the node's exclusion at the "
                        "job's next rendezvous)")
    p.add_argument("--check", action="store_true",
                   help="do not start: exit 0 if an agent serves on --socket, 5 if not (for probes)")
    p.set_defaults(func=_cmd_agent)


def _cmd_agent(args) -> int:
    from pathlib import Path

    from trainwarden.agent.node.daemon import DaemonOptions, check, run_daemon
    from trainwarden.agent.node.agent import AgentConfig, watchdog_config

    if args.check:
        return check(Path(args.socket))
    try:
        config = AgentConfig(socket_path=Path(args.socket).absolute(), metrics_host=args.metrics_host,
                             metrics_port=args.metrics_port,
                             state_home=Path(args.state_home) if args.state_home else None,
                             watchdog=watchdog_config(args.straggler_policy),
                             **({"node": args.node} if args.node else {}))
        options = DaemonOptions(agent=config, etcd=args.etcd)
    except ValueError as exc:
        print(f"trainwarden agent: {exc}", file=sys.stderr)
        return exit_codes.EXIT_USAGE
    return run_daemon(options)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainwarden",
        description="Fault-tolerant training runtime with monitoring for PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"trainwarden {__version__}")
    parser.add_argument("--log-level", default=os.environ.get("TRAINWARDEN_LOG_LEVEL", "INFO"),
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log verbosity (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_run(sub)
    _add_status_and_top(sub)
    _add_incidents(sub)
    _add_agent(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s trainwarden %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return exit_codes.EXIT_USAGE
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

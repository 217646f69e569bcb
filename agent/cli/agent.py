"""`trainwarden agent`: its arguments; the daemon itself is ``trainwarden.agent.node.daemon``."""

from __future__ import annotations

import sys

from trainwarden.agent.cli.args import add_etcd_security, etcd_security
from trainwarden.agent.common import exit_codes

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    from trainwarden.agent.node.endpoints import DEFAULT_SOCKET

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
    p.add_argument("--etcd", metavar="URL", help="also record incidents in this etcd (host:port or "
                   "http[s]://host:port)")
    p.add_argument("--straggler-policy", choices=["alert", "exclude"], default="alert",
                   help="on a straggler: alert (default) or exclude (also ask for the node's exclusion at the "
                        "job's next rendezvous)")
    p.add_argument("--check", action="store_true",
                   help="do not start: exit 0 if an agent serves on --socket, 5 if not (for probes)")
    add_etcd_security(p)
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
        options = DaemonOptions(agent=config, etcd=args.etcd, etcd_security=etcd_security(args))
    except ValueError as exc:
        print(f"trainwarden agent: {exc}", file=sys.stderr)
        return exit_codes.EXIT_USAGE
    return run_daemon(options)

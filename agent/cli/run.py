"""`trainwarden run`: its arguments; the work is ``trainwarden.agent.launch.run``."""

from __future__ import annotations

import argparse
import sys
import time

from trainwarden.agent.cli.args import add_etcd_security, etcd_security, job_name, node_name
from trainwarden.agent.common import exit_codes
from trainwarden.agent.common.launch_options import LAUNCH_OPTIONS, add_arguments

__all__ = ["add_parser"]

RUN_EXAMPLE = """\
example:
  trainwarden run --nproc-per-node 8 --max-restarts 2 --job demo -- \\
      -m trainwarden.runtime.examples.gpt --dp 2 --tp 2 --pp 2 --steps 60 --ckpt-every 10

With no --etcd, an embedded etcd is started on a free loopback port and stopped on exit.

Several nodes: run the same command on each node, with --nnodes MIN:MAX and an etcd they all reach:
  trainwarden run --nnodes 2:3 --nproc-per-node 8 --etcd e0:2379,e1:2379,e2:2379 --job big -- \
      -m trainwarden.runtime.examples.gpt --tp 2 --pp 2 --steps 1000 --ckpt-dir /shared/ckpt
A node that is lost is left out of the next rendezvous round and the job goes on with the others (data
parallelism shrinks; --dp may be omitted: world size / (tp x pp)). With --nnodes MIN:N --spare-nodes K on N+K
nodes, K wait as hot spares and a lost node's ranks go to a spare instead: the world size stays N. With no spare
left the job shrinks to MIN or more (with N:N it waits for a node).
Job state (logs, checkpoints unless --ckpt-dir is given, fault markers) goes to
$TRAINWARDEN_STATE_HOME/jobs/JOB (default ~/.local/state/trainwarden/jobs/JOB).
Faults for testing: TRAINWARDEN_FAULTS='crash:rank=3,step=12' (see trainwarden.runtime.faults).
"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "run", help="run a training script under trainwarden on this node (embedded etcd by default)",
        description="Run SCRIPT (or -m MODULE) with torchrun under trainwarden: etcd3 rendezvous, "
                    "restarts, fault recovery, a summary at the end.",
        epilog=RUN_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)  # the launch options, declared once: agent/common/launch_options.py
    p.add_argument("--etcd", metavar="URL", help="use this etcd (host:port, http://host:port or https://host:port; "
                   "several members separated by commas) "
                   "instead of starting an embedded one")
    p.add_argument("--job", type=job_name, metavar="NAME", help="job name (default: run-<time>)")
    p.add_argument("--node", type=node_name, metavar="NAME", help="this node's name in the job (default: the host "
                   "name); one `trainwarden run` per node and job")
    p.add_argument("--state-home", metavar="DIR", help="root of job state directories "
                   "(default $TRAINWARDEN_STATE_HOME or ~/.local/state/trainwarden)")
    p.add_argument("--local-addr", metavar="ADDR", help="address this node advertises to its peers "
                   "and that gloo binds (default: 127.0.0.1 for a one-node job, otherwise the address of the interface that "
                   "routes to etcd, never the host name)")
    p.add_argument("--metrics-port", type=int, default=9478, metavar="PORT",
                   help="port of the in-process agent's Prometheus endpoint on --metrics-host (default 9478; 0: any free port)")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="ADDR",
                   help="address of the Prometheus endpoint (default 127.0.0.1)")
    p.add_argument("--no-agent", action="store_true",
                   help="run without the in-process agent (no telemetry, metrics or watchdog)")
    p.add_argument("--monitor-interval", type=float, default=0.25, metavar="S",
                   help="seconds between torchrun's checks of its workers (default 0.25)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="more environment for the workers (repeatable)")
    p.add_argument("--managed", action="store_true", help=argparse.SUPPRESS)  # started by the node daemon
    add_etcd_security(p)
    p.add_argument("script", nargs=argparse.REMAINDER, metavar="-- SCRIPT ARGS...",
                   help="the training script and its arguments, or -m MODULE ARGS...")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args) -> int:
    from trainwarden.agent.launch.run import RunOptions, run

    if args.managed:  # started by the node daemon, perhaps as the job's user: nothing it runs may gain privileges
        from trainwarden.agent.node.job_user import no_new_privileges
        no_new_privileges()

    script = list(args.script)
    if script and script[0] == "--":
        script = script[1:]
    if not script:
        print("trainwarden run: nothing to run; put the script after the options, e.g. "
              "`trainwarden run --nproc-per-node 2 -- train.py --lr 0.1`", file=sys.stderr)
        return exit_codes.EXIT_USAGE
    job = args.job or time.strftime("run-%Y%m%d-%H%M%S")
    extra_env = {}
    for item in args.env:
        key, eq, value = item.partition("=")
        if not key or not eq:
            print(f"trainwarden run: --env {item!r}: expected KEY=VALUE", file=sys.stderr)
            return exit_codes.EXIT_USAGE
        extra_env[key] = value
    from trainwarden.agent.common.job_spec import CHECKPOINT_DIR_ENV, reserved_env_problem
    for key in extra_env:  # what trainwarden or torchrun sets per worker would be overridden, breaking the job
        why = None if key == CHECKPOINT_DIR_ENV else reserved_env_problem(key)
        if why is not None:
            why = why.replace("the job's name is the field 'name'", "name the job with --job")
            print(f"trainwarden run: --env {key}: it {why}; remove it", file=sys.stderr)
            return exit_codes.EXIT_USAGE
    try:
        opts = RunOptions(script=script, job=job, etcd=args.etcd, etcd_security=etcd_security(args),
                          monitor_interval=args.monitor_interval, state_home=args.state_home,
                          local_addr=args.local_addr, node=args.node, agent=not args.no_agent,
                          metrics_host=args.metrics_host, metrics_port=args.metrics_port,
                          extra_env=extra_env, managed=args.managed,
                          **{option.name: getattr(args, option.name) for option in LAUNCH_OPTIONS})
    except ValueError as exc:
        print(f"trainwarden run: {exc}", file=sys.stderr)
        return exit_codes.EXIT_USAGE
    return run(opts)

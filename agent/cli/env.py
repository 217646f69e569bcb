"""`trainwarden env`: the environment that gives a job started by plain ``torchrun`` what `trainwarden run` gives
its workers, with a node agent (`trainwarden agent`) already running on the node.

    eval "$(trainwarden env --job my-job)"
    torchrun --nproc-per-node 8 --max-restarts 3 train.py     # unchanged

The workers of that torchrun then stream step times (one step per ``optimizer.step()``) and collective timing
to the agent's socket, which detects hangs and stragglers, records incidents and aborts the workers of a hung
job (torchrun restarts them when ``--max-restarts`` allows). Only the variables the workers read are set; the
user's PYTHONPATH is kept after the bootstrap's directory, and Flight Recorder settings the user chose win.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from typing import Mapping, TextIO

from trainwarden.agent.cli.args import job_name
from trainwarden.agent.common import exit_codes
from trainwarden.agent.common.launch_options import OPTIONS, add_argument
from trainwarden.agent.launch.torchrun import worker_bootstrap_dir
from trainwarden.agent.shared.contract import (AGENT_SOCKET_ENV, AUTO_INSTRUMENT_ENV, FLIGHT_RECORDER_ENV, JOB_ENV,
                                             TOKENS_PER_STEP_ENV)

__all__ = ["add_parser", "torchrun_environment"]


def torchrun_environment(*, job: str, socket: str, tokens_per_step: int = 0,
                         current: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to set for a plain torchrun's workers (module docstring), given the ``current``
    environment (the user's PYTHONPATH and Flight Recorder settings are kept)."""
    current = os.environ if current is None else current
    env = {AGENT_SOCKET_ENV: socket, JOB_ENV: job, AUTO_INSTRUMENT_ENV: "1",
           "PYTHONPATH": os.pathsep.join(p for p in (worker_bootstrap_dir(), current.get("PYTHONPATH", "")) if p)}
    if tokens_per_step:
        env[TOKENS_PER_STEP_ENV] = str(tokens_per_step)
    for key, value in FLIGHT_RECORDER_ENV.items():
        if key not in current:
            env[key] = value
    return env


def add_parser(sub) -> None:
    from trainwarden.agent.node.endpoints import DEFAULT_SOCKET

    p = sub.add_parser("env", help="the environment that instruments a job run by plain torchrun (with "
                                   "`trainwarden agent` on the node)",
                       description="Print shell `export` lines (or JSON) that make the workers of a plain torchrun "
                                   "report to the node agent with no change to the script: step times, collective "
                                   "timing, hang and straggler detection. Use: eval \"$(trainwarden env --job J)\"; "
                                   "then torchrun as usual.")
    p.add_argument("--job", type=job_name, metavar="NAME", required=True,
                   help="the job's name: its metric label and incident key (letters, digits, '-', '_', '.')")
    p.add_argument("--socket", default=os.environ.get("TRAINWARDEN_SOCKET", str(DEFAULT_SOCKET)), metavar="PATH",
                   help=f"the node agent's telemetry socket (default $TRAINWARDEN_SOCKET or {DEFAULT_SOCKET})")
    add_argument(p, "tokens_per_step")  # as `trainwarden run` and a spec take it: agent/common/launch_options.py
    p.add_argument("--json", action="store_true", help="print a JSON object instead of export lines")
    p.set_defaults(func=_cmd_env)


def _cmd_env(args, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    if (why := OPTIONS["tokens_per_step"].problem(args.tokens_per_step)) is not None:
        print(f"trainwarden env: --tokens-per-step {why}", file=sys.stderr)
        return exit_codes.EXIT_USAGE
    try:
        env = torchrun_environment(job=args.job, socket=args.socket, tokens_per_step=args.tokens_per_step)
    except ValueError as exc:
        print(f"trainwarden env: {exc}", file=sys.stderr)
        return exit_codes.EXIT_USAGE
    if not os.path.exists(args.socket):
        print(f"trainwarden env: warning: no agent socket at {args.socket} yet: start `trainwarden agent --socket "
              f"{args.socket}` on this node (the workers connect whenever it appears)", file=sys.stderr)
    if args.json:
        print(json.dumps(env, indent=2, sort_keys=True), file=out)
    else:
        for key, value in sorted(env.items()):
            print(f"export {key}={shlex.quote(value)}", file=out)
    return exit_codes.EXIT_OK

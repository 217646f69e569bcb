"""`trainwarden run`: its arguments; the work is ``trainwarden.agent.launch.run``."""

from __future__ import annotations

import argparse
import sys
import time

from trainwarden.agent.cli.args import add_etcd_security, etcd_security, job_name, node_name
from trainwarden.agent.common import exit_codes
from trainwarden.agent.shared.contract import NUMERIC_POLICIES

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
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="N", help="workers on this node (default 1)")
    p.add_argument("--nnodes", default="1", metavar="MIN:MAX", help="nodes, N or MIN:MAX (default 1)")
    p.add_argument("--spare-nodes", type=int, default=0, metavar="K",
                   help="hot spares (--nnodes MIN:N, N >= 2): start N+K nodes; N train, K wait in the rendezvous "
                        "with their imports loaded, and when a training node is lost a spare takes its ranks in the "
                        "next round, so the world size stays N; with none left the job shrinks to MIN or more "
                        "(default 0: the job shrinks at once)")
    p.add_argument("--etcd", metavar="URL", help="use this etcd (host:port, http://host:port or https://host:port; "
                   "several members separated by commas) "
                   "instead of starting an embedded one")
    p.add_argument("--max-restarts", type=int, default=3, metavar="K",
                   help="worker-group restarts before the job fails (default 3)")
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
    p.add_argument("--straggler-policy", choices=["alert", "exclude"], default="alert",
                   help="on a straggler: alert (flag, metric, incident; default) or exclude (also ask for this "
                        "node's exclusion at the job's next rendezvous: jobs/<job>/exclude/<node>)")
    p.add_argument("--link-policy", choices=["alert", "exclude"], default="alert",
                   help="on a communication regression whose link check names this node's link slow: alert "
                        "(incident with the link check's report; default) or exclude (also leave the job at a step "
                        "boundary after a checkpoint, the others go on, and cordon the node)")
    p.add_argument("--numeric-policy", choices=list(NUMERIC_POLICIES), default="rollback",
                   help="on a step whose loss or gradients are not finite (NaN, Inf), as the workers' numeric guard "
                        "sees it (the reference job's; runtime/numeric.py for your own loop): rollback (default: every "
                        "rank skips the step's update and its batch, training goes on; NaN again within 10 steps "
                        "stops the job), stop (the job stops with the evidence, no restart), or alert (an incident "
                        "only)")
    p.add_argument("--hang-floor", type=float, default=None, metavar="S",
                   help="shortest time without a step, a collective, CPU or I/O on any rank before the job counts "
                        "as hung and is restarted (default 1.5; the deadline is otherwise 5x the p99 step time). "
                        "Raise it for a script that sleeps between steps")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="more environment for the workers (repeatable)")
    warm = p.add_mutually_exclusive_group()
    warm.add_argument("--cold-workers", dest="warm_workers", action="store_false",
                      help="start every restarted worker as a new interpreter, as plain torchrun does (by default "
                           "restarted workers fork from a process that has torch and the script's imports loaded: "
                           "a restart skips the interpreters' start-up; the first round starts cold)")
    warm.add_argument("--warm-workers", dest="warm_workers", action="store_true", default=True,
                      help="warm restarts (the default; kept for scripts written for earlier releases)")
    p.add_argument("--rendezvous-round", choices=["native", "dynamic"], default="native",
                   help="native (the default): each node joins with a key of its own and one transaction closes the "
                        "round, which scales to thousands of nodes; dynamic: torch's dynamic rendezvous over etcd "
                        "(every join a compare-and-set on one shared record; 128 nodes did not gather in 9 minutes)")
    p.add_argument("--no-memory-snapshots", dest="memory_snapshots", action="store_false",
                   help="keep no per-step snapshots in shared memory (by default a job that checkpoints with "
                        "trainwarden's Checkpointer and calls its snapshot() every step restarts from the step before "
                        "a crash or a hang, from memory; on several nodes each snapshot is also copied to the next "
                        "node, so a node loss resumes from memory too: TRAINWARDEN_PEER_COPY=0 turns that off)")
    p.add_argument("--no-auto-instrument", action="store_true",
                   help="do not instrument the script by itself: without it, a script that never imports "
                        "trainwarden gets step times (one step per optimizer.step()), collective timing, hang and "
                        "straggler detection; scripts that call rt.step report their own steps either way")
    p.add_argument("--tokens-per-step", type=_tokens, default=0, metavar="N",
                   help="tokens one step processes on one rank: an auto-instrumented script's tokens/s (default: "
                        "steps/s only)")
    cost = p.add_mutually_exclusive_group()
    cost.add_argument("--flops-per-step", type=float, default=0.0, metavar="F",
                      help="the model's FLOPs per training step, all ranks together (forward and backward): exports "
                           "trainwarden_mfu_ratio and prints the MFU in the summary")
    cost.add_argument("--model-params", type=float, default=0.0, metavar="N",
                      help="or the model's parameter count: a step costs 6*N FLOPs per token the ranks report")
    p.add_argument("--peak-tflops", type=float, default=0.0, metavar="T",
                   help="one accelerator's peak TFLOPS for the MFU (default: known GPUs by their NVML name; none on CPU)")
    p.add_argument("--managed", action="store_true", help=argparse.SUPPRESS)  # started by the node daemon
    add_etcd_security(p)
    p.add_argument("script", nargs=argparse.REMAINDER, metavar="-- SCRIPT ARGS...",
                   help="the training script and its arguments, or -m MODULE ARGS...")
    p.set_defaults(func=_cmd_run)


def _tokens(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


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
        opts = RunOptions(script=script, job=job, nproc_per_node=args.nproc_per_node, nnodes=args.nnodes,
                          spare_nodes=args.spare_nodes, etcd=args.etcd, etcd_security=etcd_security(args), max_restarts=args.max_restarts,
                          monitor_interval=args.monitor_interval,
                          state_home=args.state_home, local_addr=args.local_addr, node=args.node, agent=not args.no_agent,
                          metrics_host=args.metrics_host, metrics_port=args.metrics_port,
                          straggler_policy=args.straggler_policy, link_policy=args.link_policy, hang_floor_s=args.hang_floor,
                          numeric_policy=args.numeric_policy,
                          extra_env=extra_env, managed=args.managed,
                          warm_workers=args.warm_workers, memory_snapshots=args.memory_snapshots,
                          rendezvous_round=args.rendezvous_round,
                          auto_instrument=not args.no_auto_instrument,
                          tokens_per_step=args.tokens_per_step, flops_per_step=args.flops_per_step,
                          model_params=args.model_params, peak_tflops=args.peak_tflops)
    except ValueError as exc:
        print(f"trainwarden run: {exc}", file=sys.stderr)
        return exit_codes.EXIT_USAGE
    return run(opts)

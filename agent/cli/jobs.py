"""The fleet's commands, all against etcd (agent/etcd/jobs.py): `submit JOB.toml`, `jobs`, `stop JOB`, `resume JOB`,
`cordon NODE --reason`, `drain NODE`, `uncordon NODE`, `nodes`.

Each takes ``--etcd`` (or ``TRAINWARDEN_ETCD``) and the etcd TLS/auth flags. Changing state needs credentials with
write access to the trainwarden prefix; a read-only user can still run `jobs` and `nodes` (and `status --etcd`).
Exit codes: 0 done; 2 bad input or a request that does not fit the job's state (the message says what would);
3 etcd unreachable, or it refused the credentials or the permission.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable

from trainwarden.agent.cli.args import EtcdCommandError, add_etcd_security, connect_etcd, job_name, node_name
from trainwarden.agent.common import exit_codes
from trainwarden.agent.common.job_lifecycle import JobPhase
from trainwarden.agent.launch.goodput import Goodput
from trainwarden.agent.launch.goodput_store import job_goodput

__all__ = ["add_parsers"]

_TERMINAL = {p.value for p in JobPhase if p.terminal}


def add_parsers(sub) -> None:
    def command(name: str, help_: str, func: Callable, description: str = ""):
        p = sub.add_parser(name, help=help_, description=description or help_)
        p.add_argument("--etcd", default=os.environ.get("TRAINWARDEN_ETCD"), metavar="URL",
                       help="the cluster's etcd, host:port[,host:port...] (default $TRAINWARDEN_ETCD)")
        add_etcd_security(p)
        p.set_defaults(func=lambda args: _with_control(args, func))
        return p

    p = command("submit", "submit a job (TOML spec) to the nodes' daemons", _submit,
                "Validate JOB.toml and record it in etcd as the job's next generation; every node daemon it targets "
                "starts its part. See agent/common/job_spec.py for the fields.")
    p.add_argument("spec", metavar="JOB.toml")
    p.add_argument("--check", action="store_true", help="validate the spec only; write nothing")
    p = command("jobs", "list the jobs in etcd: phase, generation, nodes, latest checkpoint", _jobs)
    p.add_argument("--json", action="store_true")
    p = command("stop", "stop a job on every node that runs it", _stop)
    p.add_argument("job", type=job_name)
    p = command("resume", "start a failed or stopped submitted job again, as its next generation", _resume)
    p.add_argument("job", type=job_name)
    p = command("cordon", "take a node out of service: its daemon starts no new job there", _cordon)
    p.add_argument("node", type=node_name)
    p.add_argument("--reason", required=True, help="why (kept with the cordon, shown by `trainwarden nodes`)")
    p = command("drain", "cordon a node and take it out of its jobs: each checkpoints at a step boundary and goes "
                         "on without it, with no step lost", _drain)
    p.add_argument("node", type=node_name)
    p.add_argument("--reason", default="drained by an operator", help="why (kept with the cordon)")
    p = command("uncordon", "put a cordoned node back in service", _uncordon)
    p.add_argument("node", type=node_name)
    p = command("nodes", "list the nodes whose daemons registered in etcd, and the cordoned ones", _nodes)
    p.add_argument("--json", action="store_true")


def _with_control(args, func: Callable) -> int:
    """Connect to etcd and run ``func(args, JobControl)``; etcd's problems as one line and an exit code."""
    from trainwarden.agent.common.job_spec import JobSpecError, load_job_spec
    from trainwarden.agent.etcd.client import describe_etcd_error, is_auth_error
    from trainwarden.agent.etcd.jobs import JobConflict, JobControl

    if getattr(args, "spec", None):  # a bad spec is reported before etcd is asked anything
        try:
            args.job_spec = load_job_spec(args.spec)
        except JobSpecError as exc:
            print(f"trainwarden {args.command}: {exc}", file=sys.stderr)
            return exit_codes.EXIT_USAGE
        if args.check:
            print(f"{args.spec}: job {args.job_spec.name} is valid")
            return exit_codes.EXIT_OK
    if not args.etcd:
        print(f"trainwarden {args.command}: which etcd? pass --etcd HOST:PORT (or set TRAINWARDEN_ETCD)",
              file=sys.stderr)
        return exit_codes.EXIT_USAGE
    try:
        client = connect_etcd(args)
    except EtcdCommandError as exc:
        print(f"trainwarden {args.command}: {exc}", file=sys.stderr)
        return exc.code
    try:
        return func(args, JobControl(client))
    except JobConflict as exc:
        print(f"trainwarden {args.command}: {exc}", file=sys.stderr)
        return exit_codes.EXIT_USAGE
    except Exception as exc:
        if is_auth_error(exc):
            print(f"trainwarden {args.command}: etcd refused: {describe_etcd_error(exc)}; this needs a user with write "
                  "access to the trainwarden prefix (read-only users can run `jobs` and `nodes`)", file=sys.stderr)
        else:
            print(f"trainwarden {args.command}: etcd at {args.etcd}: {describe_etcd_error(exc)}", file=sys.stderr)
        return exit_codes.EXIT_ETCD_UNAVAILABLE
    finally:
        client.close()


def _submit(args, control) -> int:
    spec = args.job_spec
    generation = control.submit(spec)
    where = ", ".join(spec.nodes) if spec.nodes else "any node"
    print(f"submitted job {spec.name} (generation {generation}): {spec.nnodes} node(s) of {spec.nproc_per_node} "
          f"worker(s) on {where}; `trainwarden jobs` follows it")
    return exit_codes.EXIT_OK


def _goodput(control, job: str) -> Goodput | None:
    try:
        state = job_goodput(control.client, job)
        return Goodput.from_json(state) if state is not None else None
    except (KeyError, TypeError, ValueError):
        return None


def _jobs(args, control) -> int:
    views = control.jobs()
    goodput = {v.name: _goodput(control, v.name) for v in views}
    if args.json:
        print(json.dumps([{"job": v.name, "phase": v.phase, "generation": v.generation, "managed": v.managed,
                           "nodes": v.nodes, "checkpoint": v.checkpoint, "reason": v.state.get("reason", ""),
                           "stop_requested": v.stop_requested,
                           "goodput": goodput[v.name].to_json() if goodput[v.name] else None} for v in views],
                         indent=1, sort_keys=True))
        return exit_codes.EXIT_OK
    if not views:
        print("no jobs in etcd")
        return exit_codes.EXIT_OK
    print(f"{'JOB':24} {'PHASE':11} {'GEN':>3} {'NODES (ranks)':28} {'CHECKPOINT':>10} {'GOODPUT':>7}  SINCE / REASON")
    now = time.time()
    for v in views:
        nodes = ", ".join(f"{n} ({'spare' if rec.get('spare') else rec.get('nproc_per_node', '?')})"
                          for n, rec in sorted(v.nodes.items())) or "-"
        ckpt = str((v.checkpoint or {}).get("step", "-"))
        since = _ago(now - float(v.state.get("last_change") or now))
        phase = v.phase + ("*" if v.stop_requested and v.phase not in _TERMINAL else "")
        g = goodput[v.name]
        share = f"{100 * g.ratio:.1f}%" if g is not None and g.ratio is not None else "-"
        print(f"{v.name:24} {phase:11} {v.generation:>3} {nodes[:28]:28} {ckpt:>10} {share:>7}  {since} "
              f"{v.state.get('reason', '')}"[:170])
    if any(v.stop_requested and v.phase not in _TERMINAL for v in views):
        print("* stop requested")
    return exit_codes.EXIT_OK


def _stop(args, control) -> int:
    print(control.stop(args.job))
    return exit_codes.EXIT_OK


def _resume(args, control) -> int:
    generation = control.resume(args.job)
    print(f"job {args.job} resumes as generation {generation}; its nodes' daemons start it from its latest checkpoint")
    return exit_codes.EXIT_OK


def _cordon(args, control) -> int:
    control.cordon(args.node, args.reason)
    print(f"node {args.node} cordoned ({args.reason}): its daemon starts no new work there; jobs it runs go on "
          f"(`trainwarden uncordon {args.node}` undoes it)")
    return exit_codes.EXIT_OK


def _drain(args, control) -> int:
    control.cordon(args.node, args.reason, drain=True)
    print(f"node {args.node} draining ({args.reason}): its jobs checkpoint at a step boundary and go on without it; "
          f"`trainwarden nodes` shows when it runs none (`trainwarden uncordon {args.node}` puts it back)")
    return exit_codes.EXIT_OK


def _uncordon(args, control) -> int:
    if not control.uncordon(args.node):
        print(f"node {args.node} was not cordoned")
    else:
        print(f"node {args.node} back in service")
    return exit_codes.EXIT_OK


def _nodes(args, control) -> int:
    nodes = control.nodes()
    if args.json:
        print(json.dumps(nodes, indent=1, sort_keys=True))
        return exit_codes.EXIT_OK
    if not nodes:
        print("no node has registered (start `trainwarden agent --etcd ...` on each)")
        return exit_codes.EXIT_OK
    print(f"{'NODE':20} {'STATE':10} {'VERSION':8} {'JOBS':24} CORDON")
    for name, entry in sorted(nodes.items()):
        record, cordon = entry.get("record") or {}, entry.get("cordon")
        state = ("draining" if record.get("jobs") else "drained") if cordon and cordon.get("drain") else \
            "cordoned" if cordon else ("up" if record else "down")
        jobs = ", ".join(sorted(record.get("jobs") or {})) or "-"
        why = f"{cordon.get('reason', '')} (by {cordon.get('by', '?')}, {_ago(time.time() - float(cordon.get('since') or 0))} ago)" \
            if cordon else ""
        print(f"{name:20} {state:10} {record.get('version', '-'):8} {jobs[:24]:24} {why}")
    return exit_codes.EXIT_OK


def cluster_status(args) -> int:
    """`trainwarden status --etcd URL [--job J]`: the jobs with each node's ranks, from etcd."""
    return _with_control(args, _cluster_status)


def _cluster_status(args, control) -> int:
    from trainwarden.agent.etcd.cluster import read_progress

    views = [v for v in [control.job(args.job)] if v is not None] if args.job else control.jobs()
    if args.job and not views:
        print(f"trainwarden status: no job {args.job} in etcd; `trainwarden jobs` lists them", file=sys.stderr)
        return exit_codes.EXIT_USAGE
    report = []
    for v in views:
        progress = read_progress(control.client, v.name)
        nodes = []
        for node in sorted(set(v.nodes) | set(progress)):
            member, summary = v.nodes.get(node) or {}, progress.get(node) or {}
            ranks = summary.get("ranks") or {}
            phase = "spare" if member.get("spare") else member.get("phase", "")  # waits to take a lost node's ranks
            nodes.append({"node": node, "address": member.get("address", ""), "phase": phase,
                          "nproc_per_node": member.get("nproc_per_node"), "ranks": sorted(int(r) for r in ranks),
                          "last_step": max((int(r.get("last_step", -1)) for r in ranks.values()), default=-1),
                          "connected": sum(bool(r.get("connected")) for r in ranks.values()),
                          "member": bool(member)})
        g = _goodput(control, v.name)
        report.append({"job": v.name, "phase": v.phase, "generation": v.generation,
                       "checkpoint": (v.checkpoint or {}).get("step"), "reason": v.state.get("reason", ""),
                       "nodes": nodes, "goodput": g.to_json() if g is not None else None})
    if args.json:
        print(json.dumps(report, indent=1, sort_keys=True))
        return exit_codes.EXIT_OK
    if not report:
        print("no jobs in etcd")
    for job in report:
        print(f"job {job['job']}  {job['phase']}  generation {job['generation']}  checkpoint "
              f"{job['checkpoint'] if job['checkpoint'] is not None else 'none'}  {job['reason']}"[:200])
        if job["goodput"] is not None:
            print(f"  goodput {Goodput.from_json(job['goodput']).describe()}")
        print(f"  {'NODE':20} {'ADDRESS':16} {'PHASE':11} {'RANKS':12} {'STEP':>7} {'CONNECTED':>9}")
        for n in job["nodes"]:
            ranks = ",".join(map(str, n["ranks"])) or (f"{n['nproc_per_node']} local" if n["nproc_per_node"] else "-")
            step = str(n["last_step"]) if n["last_step"] >= 0 else "-"
            connected = f"{n['connected']}/{len(n['ranks'])}" if n["ranks"] else "-"
            print(f"  {n['node']:20} {n['address'] or '-':16} {n['phase'] or ('gone' if not n['member'] else '-'):11} "
                  f"{ranks[:12]:12} {step:>7} {connected:>9}")
    return exit_codes.EXIT_OK


def _ago(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h"

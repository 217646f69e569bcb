"""`trainwarden linkcheck --job J`: measure the links between a running multi-node job's nodes and name the slow
one (a node's link and its direction, or a pair). See agent/linkcheck.

Exit codes: 0 no slow link; 1 a slow link was found or a probe could not be made; 2 bad flags or a job with
fewer than two probe-able nodes; 3 etcd does not answer.
"""

from __future__ import annotations

import json
import os
import sys

from trainwarden.agent.cli.args import EtcdCommandError, add_etcd_security, connect_etcd, job_name, positive_float
from trainwarden.agent.common import exit_codes

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    p = sub.add_parser("linkcheck", help="measure the links between a multi-node job's nodes; name a slow node or pair",
                       description="Each node of a running multi-node job measures its links to the others (one probe "
                                   "per node at a time: bandwidth both ways and round-trip time, over the job's own "
                                   "addresses); the links are compared with each other and a slow node's link (and "
                                   "which way) or a slow pair is named. Use it when collectives got slower "
                                   "(a comm_regression incident). Exit 0: no slow link; 1: a slow link or a failed "
                                   "probe; 2: bad flags or fewer than two nodes to probe; 3: etcd does not answer.")
    p.add_argument("--job", type=job_name, required=True, metavar="NAME", help="the running job")
    p.add_argument("--etcd", default=os.environ.get("TRAINWARDEN_ETCD"), metavar="URL",
                   help="the job's etcd, host:port[,host:port...] (default $TRAINWARDEN_ETCD)")
    add_etcd_security(p)
    p.add_argument("--seconds", type=positive_float, default=0.5, metavar="S",
                   help="how long each probe streams each way (default 0.5; at most 5)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_linkcheck)


def _linkcheck(args) -> int:
    from trainwarden.agent.etcd.client import describe_etcd_error
    from trainwarden.agent.etcd.membership import live_nodes
    from trainwarden.agent.linkcheck import check_links, probe_targets
    from trainwarden.agent.linkcheck.probe import MAX_SECONDS

    if not args.etcd:
        print("trainwarden linkcheck: say which etcd holds the job: --etcd host:port or $TRAINWARDEN_ETCD",
              file=sys.stderr)
        return exit_codes.EXIT_USAGE
    if args.seconds > MAX_SECONDS:
        print(f"trainwarden linkcheck: --seconds is at most {MAX_SECONDS:g}", file=sys.stderr)
        return exit_codes.EXIT_USAGE
    try:
        client = connect_etcd(args)
    except EtcdCommandError as exc:
        print(f"trainwarden linkcheck: {exc}", file=sys.stderr)
        return exc.code
    try:
        records = live_nodes(client, args.job)
    except Exception as exc:
        print(f"trainwarden linkcheck: cannot read job {args.job}'s nodes in etcd: {describe_etcd_error(exc)}",
              file=sys.stderr)
        return exit_codes.EXIT_ETCD_UNAVAILABLE
    finally:
        client.close()
    targets, missing = probe_targets(records)
    if len(targets) < 2:
        found = f"{len(records)} node(s) in etcd" + (f" ({'; '.join(missing)})" if missing else "")
        print(f"trainwarden linkcheck: job {args.job} has fewer than two nodes to probe: {found}. Is it running, "
              f"on several nodes, and is --etcd the job's etcd?", file=sys.stderr)
        return exit_codes.EXIT_USAGE
    say = (lambda line: None) if args.json else (lambda line: print(f"  {line}", flush=True))
    if not args.json:
        print(f"trainwarden linkcheck: job {args.job}: probing the links between {len(targets)} nodes "
              f"({args.seconds:g} s each way per probe)", flush=True)
    report = check_links(records, seconds=args.seconds, progress=say)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        _print_table(report)
        print(f"verdict: {report.summary()}")
    return exit_codes.EXIT_OK if report.healthy else exit_codes.EXIT_JOB_FAILED


def _print_table(report) -> None:
    rows = sorted(report.samples, key=lambda s: (s.src, s.dst))
    if not rows:
        return
    width = max(len(f"{s.src} -> {s.dst}") for s in rows)
    print(f"  {'link':<{width}}  {'out Mbit/s':>10}  {'in Mbit/s':>10}  {'rtt ms':>7}")
    for s in rows:
        mark = lambda a, b: " slow" if (a, b) in report.slow else ""  # noqa: E731
        print(f"  {s.src + ' <-> ' + s.dst:<{width}}  {s.out_mbps:>10.0f}  {s.in_mbps:>10.0f}  {s.rtt_ms:>7.2f}"
              f"{mark(s.src, s.dst) or mark(s.dst, s.src)}")

"""`trainwarden incidents [--job J] [--json]` and `trainwarden incidents show ID`.

Reads the incident files under the state home (agent/incidents.py), so it works after the run ended and
without an agent. With ``--etcd URL`` (and the etcd TLS/auth flags) it reads the copies every node's agent wrote to
etcd instead (agent/incidents/fleet.py): a job's incidents from the whole fleet, merged by time, with each one's
node; an etcd that does not answer is exit 3. The list is a table (or a JSON array); `show` prints one incident
as a readable report: what happened, the verdict on a hang's culprit with its stack, the action taken and the
outcome. The argument parsing lives in agent/cli.py; these functions return exit codes.
"""

from __future__ import annotations

import datetime
import argparse
import json
import sys
import os
from typing import TextIO

from trainwarden.agent.cli.args import EtcdCommandError, add_etcd_security, connect_etcd, job_name
from trainwarden.agent.common import exit_codes
from trainwarden.agent.incidents import Incident, list_incidents

__all__ = ["add_parser", "format_incident", "format_table", "incidents_from_etcd", "incidents_list", "incidents_show"]

_COLUMNS = ("ID", "KIND", "STATE", "JOB", "RANKS", "DETECTED", "ACTION", "OUTCOME")


def _when(ts: float) -> str:
    if not ts:
        return "-"
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _clip(text: str, width: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 1] + "…"


def format_table(incidents: list[Incident], *, nodes: bool = False) -> str:
    """One line per incident, aligned columns; ``nodes``: with the node that recorded each (the fleet's view)."""
    columns = _COLUMNS[:4] + ("NODE",) + _COLUMNS[4:] if nodes else _COLUMNS
    rows = [columns] + [(i.id, i.kind.value, i.state.value, i.job, *((i.node,) if nodes else ()),
                         ",".join(map(str, i.ranks)) or "-", _when(i.detected_at), _clip(i.action or "-", 40),
                         _clip(i.outcome or "-", 50)) for i in incidents]
    widths = [max(len(row[c]) for row in rows) for c in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def format_incident(incident: Incident) -> str:
    """A readable report of one incident."""
    i = incident
    lines = [f"incident {i.id}: {i.kind.value} in job {i.job} on {i.node}",
             f"  state:     {i.state.value}",
             f"  detected:  {_when(i.detected_at)}   updated: {_when(i.updated_at)}",
             f"  ranks:     {','.join(map(str, i.ranks)) or '-'}",
             f"  action:    {i.action or '-'}",
             f"  outcome:   {i.outcome or '-'}"]
    evidence = dict(i.evidence)
    summary = evidence.pop("summary", None)
    if summary:
        lines.append(f"  summary:   {summary}")
    verdict = evidence.pop("verdict", None)
    if verdict:
        lines.append(f"  verdict:   {verdict.get('summary', '')}")
        for lag in verdict.get("lags", ()):
            kind = "blocked elsewhere" if lag.get("blocked") else "never entered it"
            lines.append(f"    rank {lag['rank']}: group {lag.get('desc') or lag['group']} at #{lag['seq']}, peers in "
                         f"{lag['op']} #{lag['peer_seq']} ({kind})")
        for rank, status in verdict.get("unresponsive", {}).items():
            lines.append(f"    rank {rank}: did not answer ({status})")
        for rank, frames in verdict.get("stacks", {}).items():
            lines.append(f"  stack of rank {rank} (most recent call first):")
            lines.extend(f"    {frame}" for frame in frames)
    if evidence:
        lines.append("  evidence:")
        for key, value in sorted(evidence.items()):
            shown = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value
            lines.append(f"    {key}: {shown}")
    return "\n".join(lines)


def incidents_list(out: TextIO, *, root: str | os.PathLike | None = None, job: str | None = None,
                   as_json: bool = False, incidents: list[Incident] | None = None, nodes: bool = False) -> int:
    """Print the incidents (oldest first) of every job under `root`, or of `job`; ``incidents``: these instead
    (read from etcd), with their ``nodes``."""
    incidents = list_incidents(root, job) if incidents is None else incidents
    if as_json:
        json.dump([i.to_json() for i in incidents], out, indent=1, sort_keys=True)
        out.write("\n")
    elif not incidents:
        out.write(f"no incidents{f' for job {job}' if job else ''}{' in etcd' if nodes else ''}\n")
    else:
        out.write(format_table(incidents, nodes=nodes) + "\n")
    return exit_codes.EXIT_OK


def incidents_show(out: TextIO, incident_id: str, *, root: str | os.PathLike | None = None,
                   as_json: bool = False, err: TextIO | None = None, incidents: list[Incident] | None = None) -> int:
    """Print one incident, found by its id or a unique prefix of it (among ``incidents`` when given)."""
    err = err or out
    incidents = list_incidents(root) if incidents is None else incidents
    matches = [i for i in incidents if i.id == incident_id] or [i for i in incidents if i.id.startswith(incident_id)]
    if len(matches) != 1:
        problem = "no incident" if not matches else f"{len(matches)} incidents"
        err.write(f"trainwarden: {problem} matching {incident_id!r}; run `trainwarden incidents` to list them\n")
        return exit_codes.EXIT_USAGE
    if as_json:
        json.dump(matches[0].to_json(), out, indent=1, sort_keys=True)
        out.write("\n")
    else:
        out.write(format_incident(matches[0]) + "\n")
    return exit_codes.EXIT_OK


def incidents_from_etcd(args, show) -> int:
    """`incidents --etcd URL [--job J] [show ID]`: every node's incidents as etcd holds them (``show``: one)."""
    from trainwarden.agent.etcd.client import describe_etcd_error
    from trainwarden.agent.incidents.fleet import fleet_incidents

    try:
        client = connect_etcd(args)
    except EtcdCommandError as exc:
        print(f"trainwarden incidents: {exc}", file=sys.stderr)
        return exc.code
    try:
        incidents = fleet_incidents(client, job=args.job)
    except Exception as exc:  # etcd gone since connect(), or a user without read access to the prefix
        print(f"trainwarden incidents: cannot read the incidents from etcd at {args.etcd}: "
              f"{describe_etcd_error(exc)}; retry once it answers, or leave out --etcd for this node's own",
              file=sys.stderr)
        return exit_codes.EXIT_ETCD_UNAVAILABLE
    finally:
        client.close()
    if show:
        return incidents_show(sys.stdout, args.id, as_json=args.json, err=sys.stderr, incidents=incidents)
    return incidents_list(sys.stdout, job=args.job, as_json=args.json, incidents=incidents, nodes=True)


# ---- the command line ----------------------------------------------------------------------------------

def add_parser(sub) -> None:
    p = sub.add_parser("incidents", help="hangs, stragglers and failures recorded on this node",
                       description="List recorded incidents (oldest first), or `incidents show ID` for one.")
    p.add_argument("--job", type=job_name, metavar="NAME", help="only this job's incidents")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--state-home", metavar="DIR", help="root of job state directories "
                   "(default $TRAINWARDEN_STATE_HOME or ~/.local/state/trainwarden)")
    p.add_argument("--etcd", metavar="URL", help="read every node's incidents from the cluster's etcd, "
                   "host:port[,host:port...], instead of this node's state home")
    add_etcd_security(p)
    p.set_defaults(func=_cmd_incidents)
    actions = p.add_subparsers(dest="incidents_action", metavar="show ID")
    show = actions.add_parser("show", help="one incident in full: verdict, stacks, action, outcome")
    show.add_argument("id", metavar="ID", help="incident id or a unique prefix of it")
    # SUPPRESS: `incidents --json show ID` keeps the --json given before `show`
    show.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON instead of a report")
    show.add_argument("--state-home", metavar="DIR", default=argparse.SUPPRESS, help="root of job state directories")
    show.add_argument("--etcd", metavar="URL", default=argparse.SUPPRESS, help="find it among every node's "
                      "incidents in etcd")
    add_etcd_security(show, suppress=True)
    show.set_defaults(func=_cmd_incidents_show)


def _cmd_incidents(args) -> int:
    if args.etcd:
        return incidents_from_etcd(args, show=False)
    return incidents_list(sys.stdout, root=args.state_home, job=args.job, as_json=args.json)


def _cmd_incidents_show(args) -> int:
    if args.etcd:
        return incidents_from_etcd(args, show=True)
    return incidents_show(sys.stdout, args.id, root=args.state_home, as_json=args.json, err=sys.stderr)

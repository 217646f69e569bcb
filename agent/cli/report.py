"""`trainwarden report --job J [--out F.html] [--state-home DIR]`: a job's post-mortem as one HTML page.

Reads what the job left on this node (agent/report/: its history, incidents and checkpoints), writes a page that
opens offline (plotly's JavaScript is in it) and prints its path. Works after the run ended, without an agent or
etcd. A job without a state directory or without history, or plotly missing, is one line saying what to do and
``EXIT_USAGE``.
"""

from __future__ import annotations

import sys
from typing import TextIO

from trainwarden.agent.cli.args import job_name
from trainwarden.agent.common import exit_codes

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report", help="a job's post-mortem as one HTML page: step times, restarts, incidents, goodput, checkpoints",
        description="Write a job's post-mortem as one self-contained HTML page that opens offline in a browser: "
                    "step time per rank over time with the restarts, incidents and committed checkpoints on the "
                    "same timeline; where the time went (goodput); the incidents and the checkpoints. Reads the "
                    "job's state directory on this node (STATE_HOME/jobs/JOB), so it works after the run ended. "
                    "Needs plotly: pip install 'trainwarden[report]'.")
    p.add_argument("--job", type=job_name, metavar="NAME", required=True, help="the job")
    p.add_argument("--out", metavar="FILE", help="where to write the page (default STATE_HOME/jobs/JOB/report.html)")
    p.add_argument("--state-home", metavar="DIR", help="root of job state directories "
                   "(default $TRAINWARDEN_STATE_HOME or ~/.local/state/trainwarden)")
    p.set_defaults(func=_cmd_report)


def _cmd_report(args, out: TextIO | None = None) -> int:
    from trainwarden.agent.report import ReportError, gather, write_report  # numpy: only for this command

    try:
        data = gather(args.job, args.state_home)
        if data.history.skipped_lines:
            print(f"trainwarden: {data.history.skipped_lines} unreadable line(s) in {data.state_dir / 'history'} "
                  "skipped (a run killed while writing one)", file=sys.stderr)
        path = write_report(data, args.out)
    except ReportError as exc:
        print(f"trainwarden: {exc}", file=sys.stderr)
        return exit_codes.EXIT_USAGE
    print(path, file=out or sys.stdout)
    return exit_codes.EXIT_OK

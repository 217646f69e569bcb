"""`trainwarden checkpoints --job J` and `trainwarden checkpoints --job J restore-aside step-N.<state>`.

Lists a job's checkpoint directory as an operator needs it at 3 AM: what is committed (complete, and which
one the ``latest`` pointer names), what restore or a fenced commit set aside and why (from each directory's
QUARANTINE.json), and what is in flight or unfinished. ``restore-aside`` puts a set-aside checkpoint back
once the storage is fixed; it must be complete again (``--force`` to put it back anyway). ``--verify`` reads
every committed checkpoint's files against the sums recorded at commit (agent/shared/checkpoint_sums.py) and exits
8 when one differs. Works on plain directories (agent/shared/checkpoint_layout.py), without an agent, etcd or torch.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import TextIO

from trainwarden.agent.cli.args import job_name
from trainwarden.agent.common import exit_codes
from trainwarden.agent.common.paths import job_checkpoint_dir
from trainwarden.agent.shared import checkpoint_aside as asides
from trainwarden.agent.shared import checkpoint_layout as store
from trainwarden.agent.shared import checkpoint_sums

__all__ = ["add_parser", "checkpoint_rows", "format_rows"]


def _when(ts: float | None) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def checkpoint_rows(directory: Path) -> list[dict]:
    """One row per checkpoint directory, newest step first: step, state, name, detail, time."""
    latest = store.read_latest(directory)
    rows = []
    for status in store.scan(directory):
        if status.complete:
            state = "committed"
            detail = "the latest pointer names it" if latest is not None and latest.step == status.step else ""
        elif status.state == store.UNFINISHED:
            state, detail = "in flight or unfinished", "; ".join(status.problems)
        else:
            state, detail = status.state, "; ".join(status.problems)
        rows.append({"step": status.step, "state": state, "name": status.path.name, "detail": detail,
                     "time": _mtime(status.path)})
    for aside in asides.list_set_aside(directory):
        rows.append({"step": aside.step, "state": f"set aside ({aside.state})", "name": aside.path.name,
                     "detail": aside.reason or "no QUARANTINE.json note", "time": aside.time})
    if latest is not None and not any(r["step"] == latest.step and r["state"] == "committed" for r in rows):
        rows.append({"step": latest.step, "state": "pointer only", "name": store.POINTER_NAME,
                     "detail": f"the latest pointer names step {latest.step} ({latest.path}), which is not complete "
                               "here", "time": latest.time})
    return sorted(rows, key=lambda r: (r["step"], r["name"]), reverse=True)


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def format_rows(rows: list[dict]) -> str:
    header = ("STEP", "STATE", "DIRECTORY", "WHEN", "DETAIL")
    table = [header] + [(str(r["step"]), r["state"], r["name"], _when(r["time"]), " ".join(r["detail"].split())[:160])
                        for r in rows]
    widths = [max(len(row[c]) for row in table) for c in range(len(header) - 1)]
    return "\n".join("  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[-1]]).rstrip()
                     for row in table)


def add_parser(sub) -> None:
    p = sub.add_parser("checkpoints", help="a job's checkpoints: committed, set aside (and why), in flight",
                       description="List a job's checkpoints on this node: committed ones, the ones restore set "
                                   "aside with the reason, saves in flight. `checkpoints --job J restore-aside "
                                   "step-N.<state>` puts a set-aside checkpoint back after the storage is fixed.")
    p.add_argument("--job", type=job_name, metavar="NAME", required=True, help="the job")
    p.add_argument("--dir", metavar="DIR", help="the checkpoint directory (default: what the job's last run "
                                                "recorded, else STATE_HOME/jobs/JOB/checkpoints)")
    p.add_argument("--state-home", metavar="DIR", help="root of job state directories "
                   "(default $TRAINWARDEN_STATE_HOME or ~/.local/state/trainwarden)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--verify", action="store_true", help="read every committed checkpoint's files and check them "
                   "against the sums recorded at commit; exit 8 when one differs")
    p.set_defaults(func=_cmd_list)
    actions = p.add_subparsers(dest="checkpoints_action", metavar="restore-aside NAME")
    back = actions.add_parser("restore-aside", help="put a set-aside checkpoint back as step-N")
    back.add_argument("name", metavar="NAME", help="the set-aside directory, e.g. step-00000012.corrupt")
    back.add_argument("--force", action="store_true", help="put it back even if it is still not complete")
    back.set_defaults(func=_cmd_restore_aside)


def _directory(args) -> Path:
    return Path(args.dir) if args.dir else job_checkpoint_dir(args.job, args.state_home)


def _cmd_list(args, out: TextIO = sys.stdout) -> int:
    directory = _directory(args)
    if not directory.is_dir():
        print(f"trainwarden: no checkpoint directory {directory} for job {args.job} (give it with --dir)",
              file=sys.stderr)
        return exit_codes.EXIT_USAGE
    try:
        rows = checkpoint_rows(directory)
        corrupt = _verify_rows(directory, rows) if getattr(args, "verify", False) else 0
    except OSError as exc:
        print(f"trainwarden: cannot read {directory}: {exc}", file=sys.stderr)
        return exit_codes.EXIT_USAGE
    if args.json:
        print(json.dumps({"directory": str(directory), "checkpoints": rows}, indent=1), file=out)
    elif not rows:
        print(f"{directory}: no checkpoints", file=out)
    else:
        print(f"{directory}\n{format_rows(rows)}", file=out)
    if corrupt:
        print(f"trainwarden: {corrupt} committed checkpoint(s) differ from the sums recorded at commit: the job's "
              "next restore sets them aside and uses the newest good one", file=sys.stderr)
        return exit_codes.EXIT_CHECKPOINT_CORRUPT
    return exit_codes.EXIT_OK


def _verify_rows(directory: Path, rows: list[dict]) -> int:
    """Check each committed row's files against its recorded sums (``verified`` in the row); how many differ."""
    corrupt = 0
    for row in rows:
        if row["state"] != "committed":
            continue
        path = directory / row["name"]
        sums = checkpoint_sums.recorded_sums(path)
        if not sums:
            row["verified"] = "unverified (no sums recorded at commit)"
            continue
        wrong = checkpoint_sums.verify(path, sums=sums)
        if wrong:
            corrupt += 1
            row["state"] = "CORRUPT"
            row["verified"] = "; ".join(str(m) for m in wrong)
            row["detail"] = " ".join(filter(None, [row["verified"], row["detail"]]))
        else:
            row["verified"] = f"ok ({len(sums)} files, {checkpoint_sums.ALGORITHM})"
            row["detail"] = "; ".join(filter(None, [row["detail"], f"verified: {row['verified']}"]))
    return corrupt


def _cmd_restore_aside(args, out: TextIO = sys.stdout) -> int:
    directory = _directory(args)
    try:
        target, state = asides.restore_aside(directory, args.name, force=args.force)
    except (store.CheckpointError, OSError) as exc:
        print(f"trainwarden: {exc}", file=sys.stderr)
        return exit_codes.EXIT_USAGE
    note = "" if state == store.COMPLETE else f" (still {state}: put back with --force)"
    print(f"put {args.name} back as {target}{note}; the job's next restore will consider it "
          f"(`trainwarden resume {args.job}` for a submitted job)", file=out)
    return exit_codes.EXIT_OK

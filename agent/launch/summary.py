"""The summary ``trainwarden run`` prints when the job ends: steps, restarts and the time they cost, the
latest complete checkpoint, the incidents recorded, where the log is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO

from trainwarden.agent.common.job_lifecycle import JobRecord
from trainwarden.agent.incidents import list_incidents
from trainwarden.agent.launch.goodput import Goodput
from trainwarden.agent.launch.progress import JobProgress
from trainwarden.agent.shared import checkpoint_aside as asides
from trainwarden.agent.shared import checkpoint_layout as store
from trainwarden.agent.telemetry.job_telemetry import steps_from

__all__ = ["print_summary"]


def _latest_checkpoint(directory: Path, job: str) -> str:
    """"latest complete: step 70", or what is wrong with it, and how many checkpoints are set aside."""
    pointer = directory / store.POINTER_NAME
    try:
        info = json.loads(pointer.read_text())
        step = int(info["step"])
        latest = f"latest complete: step {step}"
        if not (directory / store.step_dir(directory, step).name / store.METADATA_NAME).exists():
            latest = f"the latest pointer names step {step}, which is no longer complete here"
    except FileNotFoundError:
        latest = "none committed"
    except (ValueError, KeyError, TypeError, OSError) as exc:
        latest = f"unreadable pointer {pointer}: {exc}"
    aside = asides.list_set_aside(directory) if directory.is_dir() else []
    if aside:
        latest += f"; {len(aside)} set aside: trainwarden checkpoints --job {job}"
    return latest


def step_source(agent, job: str) -> str | None:
    """Where the job's step counts came from, as the node ``agent`` saw its ranks (None: no agent, no ranks)."""
    if agent is None:
        return None
    try:
        snaps = agent.job_telemetry.snapshot(job)
    except Exception:
        return None
    return (steps_from(snaps[0].ranks) or None) if snaps else None


def print_summary(out: TextIO, *, record: JobRecord, state_dir: Path, progress: JobProgress, elapsed: float,
                  ckpt_dir: Path, log_path: Path, steps_from: str | None = None,
                  goodput: Goodput | None = None, mfu: str | None = None) -> None:
    """The end-of-run summary of the job ``record`` names; ``steps_from`` is `step_source`'s answer."""
    lines = [f"trainwarden: job {record.job} {record.phase.value} after {elapsed:.1f}s"]
    blocked = record.reason.startswith("resume blocked")
    if blocked:  # the restore stopped the job: no step, no restart, nothing lost but the attempt
        lines.append("  steps        none: the job stopped before its first step rather than start over (its "
                     "checkpoints could not be read or loaded)")
    elif progress.max_step is not None:
        median = progress.median_step_seconds()
        loss = f", last loss {progress.last_loss}" if progress.last_loss is not None else ""
        source = f" (from {steps_from})" if steps_from and steps_from != "collectives only" else ""
        lines.append(f"  steps        last step {progress.max_step}{loss}, median step {median:.3f}s{source}")
    elif steps_from == "collectives only":
        lines.append("  steps        none (collectives only: no optimizer stepped; hangs were detected from the "
                     "collectives)")
    else:
        lines.append("  steps        none reported (the script sends no telemetry: leave auto-instrumentation on, "
                     "or wrap each step in trainwarden.runtime's rt.step)")
    if progress.failures and not blocked:
        # without a step (collectives only, no telemetry) the time lost has nothing to be measured by, and
        # whether a round got past the failure cannot be told: "not recovered" would be a guess
        unmeasured = "time lost unknown (no steps)" if progress.max_step is None else "not recovered"
        parts = []
        for f in progress.failures:
            lost = f"{f.lost_seconds:.1f}s lost" if f.lost_seconds is not None else unmeasured
            where = f"failed after step {f.last_step}" if f.last_step is not None else "failed before any step"
            resumed = f", resumed at step {f.resumed_from}" if f.resumed_from is not None else ""
            parts.append(f"{where}{resumed}, {lost}")
        lines.append(f"  restarts     {progress.restarts} ({'; '.join(parts)})")
        if progress.max_step is not None:
            lines.append(f"  time lost    {progress.lost_seconds:.1f}s to failures")
    else:
        lines.append("  restarts     0")
    if goodput is not None and goodput.ratio is not None and not blocked:
        lines.append(f"  goodput      {goodput.describe()}")
    if mfu:
        lines.append(f"  mfu          {mfu}")
    lines.append(f"  checkpoints  {ckpt_dir} ({_latest_checkpoint(ckpt_dir, record.job)})")
    incidents = _incident_summary(state_dir)
    if incidents:
        lines.append(f"  incidents    {incidents} (trainwarden incidents --job {record.job})")
    lines.append(f"  log          {log_path}")
    print("\n".join(lines), file=out, flush=True)


def _incident_summary(state_dir: Path) -> str:
    """"hang 1 (rank 2), crash 1 (rank 5; 7 collateral), node_lost 1 (n2: ranks 4,5)" from the job's incident
    records; "" when there are none."""
    try:
        found = list_incidents(state_dir)
    except (OSError, ValueError) as exc:
        return f"unreadable ({exc})"
    kinds: dict[str, list] = {}
    for incident in found:
        kinds.setdefault(incident.kind.value, []).append(incident)
    parts = []
    for kind, items in sorted(kinds.items()):
        named = _named(kind, items)
        parts.append(f"{kind} {len(items)}{f' ({named})' if named else ''}")
    return ", ".join(parts)


def _ranks(ranks) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}" if ranks else ""


def _named(kind: str, items: list) -> str:
    """What the incidents of one kind name: the node lost, the first failed rank and its collateral, the ranks."""
    if kind == "node_lost":  # the node is the news
        return "; ".join(i.node + (f": {_ranks(i.ranks)}" if i.ranks else "") for i in items)
    if kind == "restart":
        return ""
    ranks = sorted({r for i in items for r in i.ranks})
    collateral = {r for i in items for r in i.evidence.get("collateral") or ()} - set(ranks)
    return _ranks(ranks) + (f"; {len(collateral)} collateral" if collateral and kind == "crash" else "")

"""What can be checked before anything is launched, so that a mistake is one clear error, not a worker group
that fails and is restarted until the budget is spent.

- The script exists (a path), or the top-level package of ``-m MODULE`` can be found (found, not imported:
  importing a user's package could be slow or have effects).
- ``TRAINWARDEN_FAULTS``, if set, parses (agent/shared/fault_spec.py: the workers parse it the same way).

A failure that only shows once the workers run, the same way twice before any step, is caught by the
supervisor instead (agent/launch/run.py); both end with ``EXIT_CONFIG``. The node daemon runs the same checks
before it starts a submitted job's launcher (agent/node/job_refusal.py), so a node that cannot run it refuses it once.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Mapping, Sequence

from trainwarden.agent.shared.fault_spec import ENV_VAR as FAULTS_ENV, FaultSpecError, parse_faults

__all__ = ["preflight"]


def preflight(script: Sequence[str], env: Mapping[str, str], *, cwd: str | os.PathLike | None = None) -> list[str]:
    """Problems that would make every worker fail at once; empty when none is found."""
    problems = []
    if script and script[0] == "-m":
        module = script[1] if len(script) > 1 else ""
        top = module.split(".")[0]
        try:
            found = bool(top) and importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            problems.append(f"module {module!r} cannot be found: no package {top!r} for this Python "
                            f"({os.path.realpath(os.sys.executable)}); install it or fix the name after -m")
    elif script:
        path = Path(cwd or ".") / script[0]
        if not path.is_file():
            problems.append(f"script {script[0]!r} does not exist{f' in {cwd}' if cwd else ''}; give its path "
                            "(or -m MODULE) after --")
    spec = env.get(FAULTS_ENV, "")
    if spec:
        try:
            parse_faults(spec)
        except FaultSpecError as exc:
            problems.append(f"{FAULTS_ENV}: {exc}")
    return problems

"""A submitted job this node's daemon cannot run: one incident and a phase that says why, not a log line per poll.

Two kinds of refusal reach the job runner (agent/node/job_runner.py):

* the spec in etcd does not parse (``JobSpecError``: the same validation `submit` runs, agent/common/job_spec.py;
  a hand-edited record, or a field this release does not know);
* this node cannot run it (``node_problems``, checked as the job's user): the script or the ``-m`` package is
  missing here (or that user cannot see it), the fault spec
  does not parse (agent/common/preflight.py, what the launcher would stop on with exit 6), or the checkpoint
  directory is missing and so is its parent (a shared filesystem that is not mounted here: starting the job
  would write its checkpoints to the node's own disk and start it over from step 1).

``JobRefusals.refuse`` acts once per job, generation and spec revision: a generation still ``pending`` that no node
has joined becomes ``refused`` (one transaction, so of several refusing daemons one wins and records), otherwise the
job goes on without this node. Either way one ``job_refused`` incident is recorded through the daemon's incident
store (the state home and etcd) and one line is logged. The decisions made are kept in
``<state home>/daemon/refused.json``, so a restarted daemon does not record them again. A new generation
(`trainwarden resume`, or `submit` again) or a new spec revision is looked at afresh.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from trainwarden.agent.common.job_lifecycle import JobPhase
from trainwarden.agent.common.job_spec import JobSpec
from trainwarden.agent.common.preflight import preflight
from trainwarden.agent.etcd.jobs import JobControl, JobView
from trainwarden.agent.incidents.record import Incident, IncidentKind, IncidentState, new_incident_id
from trainwarden.agent.node.job_user import JobUser, launch_identity
from trainwarden.agent.shared.atomic_file import atomic_write

logger = logging.getLogger(__name__)

__all__ = ["JobRefusals", "PREFLIGHT_TIMEOUT_S", "node_problems"]


def node_problems(spec: JobSpec, *, cwd: str | os.PathLike | None = None, user: JobUser | None = None,
                  python: str = sys.executable) -> list[str]:
    """Why this node cannot start ``spec``'s launcher (empty: it can). ``cwd``: where the launcher would run.
    ``user``: who it runs as; when that is not this process's user the checks run in a child started as ``user``
    (with ``python``), so that they see what the job will see and a refusal does not tell the submitter whether a
    path only root may see exists (issue 44)."""
    if user is not None and user.uid != os.geteuid():
        return _problems_as(spec, user, python=python, cwd=cwd)
    problems = preflight(spec.command, {**os.environ, **spec.env}, cwd=cwd)
    if spec.checkpoint_dir:
        path = Path(cwd or ".") / spec.checkpoint_dir
        if path.exists() and not path.is_dir():
            problems.append(f"checkpoint_dir {spec.checkpoint_dir!r} is not a directory on this node")
        elif not path.exists() and not path.parent.is_dir():
            problems.append(f"checkpoint_dir {spec.checkpoint_dir!r} is missing on this node and so is its parent "
                            f"{str(path.parent)!r}; mount the shared filesystem (or create the parent) and resume "
                            "the job")
    return problems


_CHILD = ("import json, sys\n"
          "from trainwarden.agent.common.job_spec import JobSpec\n"
          "from trainwarden.agent.node.job_refusal import node_problems\n"
          "request = json.loads(sys.stdin.read())\n"
          "print(json.dumps(node_problems(JobSpec.from_json(request['spec'], 'preflight'), cwd=request['cwd'])))\n")
PREFLIGHT_TIMEOUT_S = 60.0
"""How long the checks run as the job's user may take (a Python start and a few stats; a hung network
filesystem is the slow case)."""


def _problems_as(spec: JobSpec, user: JobUser, *, python: str, cwd: str | os.PathLike | None) -> list[str]:
    identity = launch_identity(user, dict(os.environ), python=python)
    request = json.dumps({"spec": spec.to_json(), "cwd": str(cwd) if cwd is not None else None})
    try:  # switched after exec, as the launcher is: the daemon's Popen stays a vfork (job_user.launch_identity)
        done = subprocess.run(identity.argv([python, "-c", _CHILD]), input=request, capture_output=True, text=True,
                              timeout=PREFLIGHT_TIMEOUT_S, close_fds=True, env=identity.env)
        if done.returncode == 0:
            problems = json.loads(done.stdout)
            if isinstance(problems, list) and all(isinstance(p, str) for p in problems):
                return problems
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        why = str(exc)
    return [f"the checks before the launch could not run as {user} ({why[:300]}): make {python} runnable by that "
            "user, or submit the job with a user that can run it"]


class JobRefusals:
    """Refuses a job once per (generation, spec revision) on this node (module docstring)."""

    def __init__(self, control: JobControl, *, node: str, path: Path,
                 record: Callable[[Incident], Incident] | None = None) -> None:
        self._control, self._node, self._path, self._record = control, node, Path(path), record
        self._done: dict[str, list[int]] = self._load()

    def refused(self, view: JobView) -> bool:
        """Whether this node already refused this generation and spec revision of the job."""
        return self._done.get(view.name) == [view.generation, view.spec_revision]

    def refuse(self, view: JobView, why: str) -> None:
        """Refuse ``view``'s job on this node for ``why`` (once: ``refused`` says whether it was)."""
        if self.refused(view):
            return
        whole = view.phase == JobPhase.PENDING.value and not view.nodes
        reason = f"refused by node {self._node}: {why}"
        if whole and not self._control.refuse(view.name, view.generation, reason):
            return  # it changed meanwhile (started elsewhere, stopped, refused by another node): next round decides
        action = (f"generation {view.generation} refused: phase {JobPhase.REFUSED.value}" if whole
                  else "not started on this node; the job goes on without it")
        logger.error("job %s generation %d: %s; %s. Fix it, then `trainwarden resume %s` (or submit it again)",
                     view.name, view.generation, reason, action, view.name)
        self._done[view.name] = [view.generation, view.spec_revision]
        self._save()
        if self._record is not None:
            self._record(Incident(
                id=new_incident_id(), kind=IncidentKind.JOB_REFUSED, job=view.name, node=self._node,
                evidence={"reason": why, "generation": view.generation, "spec_revision": view.spec_revision,
                          "phase_before": view.phase},
                detected_at=time.time(), state=IncidentState.RESOLVED, action=action,
                outcome=f"fix it, then `trainwarden resume {view.name}` or submit the job again"))

    def _load(self) -> dict[str, list[int]]:
        try:
            data = json.loads(self._path.read_text())
            return {str(k): [int(v[0]), int(v[1])] for k, v in data.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, IndexError, AttributeError) as exc:
            logger.warning("ignoring %s (%s): jobs refused before may be refused (and recorded) again", self._path,
                           exc)
            return {}

    def _save(self) -> None:
        try:
            atomic_write(self._path, json.dumps(self._done, sort_keys=True).encode())
        except OSError as exc:  # the decision stands for this daemon's life; a restart may record it again
            logger.warning("cannot write %s (%s)", self._path, exc)

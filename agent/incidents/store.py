"""Where incidents are kept: the job's state directory, and a copy in etcd.

Storage: ``<job state dir>/incidents/<id>.json`` (written to a temporary file and renamed, so a reader never
sees half a record), outliving the run so that `trainwarden incidents` works afterwards; when an etcd
client is given, a copy under ``<prefix>/jobs/<job>/incidents/<id>``. The file is the record; etcd failures
are logged and do not lose it. The first version of each incident is counted in the `IncidentCollector`
(counters.py). The straggler policy ``exclude``'s requests to leave a node out are kept here too.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

from trainwarden.agent.common.paths import default_state_home, job_state_dir
from trainwarden.agent.etcd.keys import DEFAULT_PREFIX, job_key
from trainwarden.agent.incidents.counters import IncidentCollector
from trainwarden.agent.incidents.record import Incident
from trainwarden.agent.proto.atomic_file import atomic_write

__all__ = ["IncidentStore", "list_incidents"]

log = logging.getLogger(__name__)


class IncidentStore:
    """Writes incidents to ``<state_dir(job)>/incidents/`` and, optionally, to etcd."""

    def __init__(self, *, state_dir: Callable[[str], Path] = job_state_dir, etcd=None,
                 prefix: str = DEFAULT_PREFIX, collector: IncidentCollector | None = None) -> None:
        self._state_dir = state_dir
        self._etcd = etcd
        self._prefix = prefix.rstrip("/")
        self._collector = collector
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._listeners: list[Callable[[Incident], None]] = []
        self.write_errors = 0
        """Incident versions that could not be written to the state directory (logged instead)."""

    def add_listener(self, listener: Callable[[Incident], None]) -> None:
        """Also hand every version recorded from now on to ``listener`` (after it is stored; its errors are
        logged, never raised to the recorder)."""
        self._listeners.append(listener)

    def record(self, incident: Incident) -> Incident:
        """Store this version of `incident`; the first version of an id is counted and logged."""
        data = json.dumps(incident.to_json(), indent=1, sort_keys=True, default=str)
        directory: Path | str = f"the state directory of job {incident.job!r}"
        try:
            directory = Path(self._state_dir(incident.job)) / "incidents"
            directory.mkdir(parents=True, exist_ok=True)
            atomic_write(directory / f"{incident.id}.json", data.encode())
        except (OSError, ValueError) as exc:  # a full disk (or a bad name) must not stop the action it is about
            self.write_errors += 1
            log.error("cannot write incident %s to %s (%s); it is logged here and mirrored to etcd if set: %s",
                      incident.id, directory, exc, data.replace("\n", " "))
        with self._lock:
            first = incident.id not in self._seen
            self._seen.add(incident.id)
        if first:
            if self._collector is not None:
                self._collector.count(incident.job, incident.kind)
            log.warning("incident %s: %s in job %s ranks %s on %s; action: %s", incident.id, incident.kind.value,
                        incident.job, list(incident.ranks), incident.node, incident.action or "none",
                        extra={"incident": incident.id, "kind": incident.kind.value, "job": incident.job,
                               "ranks": list(incident.ranks), "node": incident.node})
        if self._etcd is not None:
            key = job_key(incident.job, "incidents", incident.id, prefix=self._prefix)
            try:
                self._etcd.put(key, data)
            except Exception as exc:  # the file is the record; etcd is a mirror
                log.warning("cannot mirror incident %s to etcd (%s); it is kept in %s", incident.id, exc, directory)
        for listener in self._listeners:
            try:
                listener(incident)
            except Exception:
                log.exception("incident listener %s failed on %s", listener, incident.id)
        return incident


    def request_exclusion(self, job: str, node: str, request: Mapping[str, Any]) -> None:
        """Record that `node` should be left out of `job`'s next rendezvous (the straggler policy
        ``exclude``): ``<state_dir(job)>/exclusions/<node>.json`` and ``<prefix>/jobs/<job>/exclude/<node>``.
        The cluster side reads it when it forms the next round; nothing here stops a running worker."""
        data = json.dumps(dict(request), indent=1, sort_keys=True, default=str)
        log.warning("requesting that node %s be left out of job %s's next rendezvous: %s", node, job,
                    request.get("reason", "no reason given"), extra={"job": job, "node": node})
        directory = Path(self._state_dir(job)) / "exclusions"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            atomic_write(directory / f"{node}.json", data.encode())
        except OSError as exc:
            log.error("cannot record the exclusion of node %s from job %s in %s (%s): %s", node, job, directory,
                      exc, data.replace("\n", " "))
        if self._etcd is not None:
            try:
                self._etcd.put(job_key(job, "exclude", node, prefix=self._prefix), data)
            except Exception as exc:
                log.warning("cannot record the exclusion of node %s from job %s in etcd (%s)", node, job, exc)

    def withdraw_exclusion(self, job: str, node: str) -> None:
        """The straggler recovered before the next round: the exclusion request no longer holds."""
        log.info("withdrawing the request to leave node %s out of job %s", node, job,
                 extra={"job": job, "node": node})
        try:
            (Path(self._state_dir(job)) / "exclusions" / f"{node}.json").unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot withdraw the exclusion of node %s from job %s (%s)", node, job, exc)
        if self._etcd is not None:
            try:
                self._etcd.delete(job_key(job, "exclude", node, prefix=self._prefix))
            except Exception as exc:
                log.warning("cannot withdraw the exclusion of node %s from job %s in etcd (%s)", node, job, exc)


def _incident_dirs(root: Path, job: str | None) -> list[Path]:
    if (root / "incidents").is_dir():  # a job's state directory
        return [root / "incidents"]
    if job is not None:
        return [root / "jobs" / job / "incidents"]
    return sorted(p / "incidents" for p in (root / "jobs").glob("*") if (p / "incidents").is_dir())


def list_incidents(root: str | os.PathLike | None = None, job: str | None = None) -> list[Incident]:
    """Every incident under `root` (a state home, default `default_state_home()`, or one job's state
    directory), oldest first; only `job`'s when given. Unreadable files are skipped with a warning."""
    base = Path(root) if root is not None else default_state_home()
    found = []
    for directory in _incident_dirs(base, job):
        for path in directory.glob("*.json"):
            try:
                incident = Incident.from_json(json.loads(path.read_text()))
            except (OSError, ValueError, TypeError) as exc:
                log.warning("skipping unreadable incident file %s: %s", path, exc)
                continue
            if job is None or incident.job == job:
                found.append(incident)
    return sorted(found, key=lambda i: i.id)

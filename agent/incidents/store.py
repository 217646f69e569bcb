"""Where incidents are kept: a directory of records per job, and a copy in etcd.

Storage: ``<job state dir>/incidents/<id>.json`` for a launcher, which runs as the job's user; for the node
daemon, which is root and must never write inside a tree the job's user owns (a link there would point root's
write anywhere; issue 44), ``<state home>/daemon/records/<job>/incidents/<id>.json`` (0755 directories, 0644 files,
root's: the user reads them). Each file is written to a temporary file and renamed, so a reader never sees half a
record, and outlives the run so that `trainwarden incidents` (which reads both places) works afterwards; when an
etcd client is given, a copy under ``<prefix>/jobs/<job>/incidents/<id>``. The file is the record; etcd failures
are logged and do not lose it. The first version of each incident is counted in the `IncidentCollector`
(counters.py). The straggler policy ``exclude``'s requests to leave a node out are kept here too."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

from trainwarden.agent.common.paths import default_state_home, job_state_dir, records_home
from trainwarden.agent.common.untrusted_fs import read_small
from trainwarden.agent.etcd.keys import DEFAULT_PREFIX, job_key
from trainwarden.agent.incidents.counters import IncidentCollector
from trainwarden.agent.incidents.record import Incident
from trainwarden.agent.shared.atomic_file import atomic_write

__all__ = ["IncidentStore", "list_incidents"]

log = logging.getLogger(__name__)


class IncidentStore:
    """Writes incidents to ``<state_dir(job)>/incidents/`` and, optionally, to etcd."""

    def __init__(self, *, state_dir: Callable[[str], Path] = job_state_dir, etcd=None,
                 prefix: str = DEFAULT_PREFIX, collector: IncidentCollector | None = None,
                 readable: bool = False) -> None:
        """``state_dir``: where a job's records go (``<it>/incidents``, ``<it>/exclusions``). ``readable``: the
        directories made are 0755 and the files 0644, for the node daemon's records about a job
        (``job_records_dir``), which root owns and the job's user reads; otherwise files are 0600."""
        self._state_dir = state_dir
        self._dir_mode, self._file_mode = (0o755, 0o644) if readable else (None, None)
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
            directory = self._mkdir(Path(self._state_dir(incident.job)) / "incidents")
            atomic_write(directory / f"{incident.id}.json", data.encode(), mode=self._file_mode)
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


    def _mkdir(self, directory: Path) -> Path:
        if self._dir_mode is None:
            directory.mkdir(parents=True, exist_ok=True)
            return directory
        for level in (directory.parent, directory):  # the job's directory and this one: the user lists them
            if not level.is_dir():
                level.mkdir(parents=True, exist_ok=True)
                os.chmod(level, self._dir_mode)
        return directory

    def request_exclusion(self, job: str, node: str, request: Mapping[str, Any]) -> None:
        """Record that `node` should be left out of `job`'s next rendezvous (the straggler policy
        ``exclude``): ``<state_dir(job)>/exclusions/<node>.json`` and ``<prefix>/jobs/<job>/exclude/<node>``.
        The cluster side reads it when it forms the next round; nothing here stops a running worker."""
        data = json.dumps(dict(request), indent=1, sort_keys=True, default=str)
        log.warning("requesting that node %s be left out of job %s's next rendezvous: %s", node, job,
                    request.get("reason", "no reason given"), extra={"job": job, "node": node})
        directory = Path(self._state_dir(job)) / "exclusions"
        try:
            self._mkdir(directory)
            atomic_write(directory / f"{node}.json", data.encode(), mode=self._file_mode)
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
    """The incident directories under ``root``: a job's state directory (and the daemon's records about that job
    beside its state home), or a state home (every job's, or ``job``'s: theirs and the daemon's records)."""
    if (root / "incidents").is_dir() or root.parent.name == "jobs":  # a job's state directory
        records = records_home(root.parent.parent) / root.name / "incidents"
        return [d for d in (root / "incidents", records) if d.is_dir()]
    if job is not None:
        return [root / "jobs" / job / "incidents", records_home(root) / job / "incidents"]
    found = [p / "incidents" for p in (root / "jobs").glob("*") if (p / "incidents").is_dir()]
    found += [p / "incidents" for p in records_home(root).glob("*") if (p / "incidents").is_dir()]
    return sorted(found)


def list_incidents(root: str | os.PathLike | None = None, job: str | None = None) -> list[Incident]:
    """Every incident under `root` (a state home, default `default_state_home()`, or one job's state
    directory), oldest first; only `job`'s when given. The launchers' records (in each job's state directory, the
    job's user's) and the node daemon's (``<state home>/daemon/records/<job>``, root's) are both read; the former
    without following a link or blocking on a special file (root may be the reader). Unreadable files are skipped
    with a warning."""
    base = Path(root) if root is not None else default_state_home()
    found: dict[str, Incident] = {}
    for directory in _incident_dirs(base, job):
        try:
            names = sorted(entry.name for entry in os.scandir(directory) if entry.name.endswith(".json"))
        except OSError:
            continue
        for name in names:
            path = directory / name
            try:
                incident = Incident.from_json(json.loads(read_small(path, _RECORD_LIMIT, under=directory.parent)))
            except (OSError, ValueError, TypeError) as exc:
                log.warning("skipping unreadable incident file %s: %s", path, exc)
                continue
            if job is None or incident.job == job:
                found.setdefault(incident.id, incident)
    return sorted(found.values(), key=lambda i: i.id)


_RECORD_LIMIT = 4 << 20
"""The largest incident file read (a hang's carries its ranks' stacks)."""

"""Incident records: what the watchdog saw, what it did, and how it ended.

One `Incident` per event worth a human's attention: a hang, a straggler starting or ending, a crash, a
restart. Each has a sortable id (UTC time to the millisecond plus 6 random hex digits, so ids from
different agents never collide and `ls` shows them in order), the evidence that led to it, the action
taken and the outcome. Incidents have a lifecycle::

    open -> acting -> resolved
      \\        \\---> failed
       \\-> resolved | failed

checked against `_TRANSITIONS` (an illegal one raises `IllegalIncidentTransition`, a bug) and logged.
`Incident` is frozen: `transition()` returns the next version, and `IncidentStore.record()` stores each
version under the same id.

Storage: ``<job state dir>/incidents/<id>.json`` (written to a temporary file and renamed, so a reader never
sees half a record), outliving the run so that `trainwarden incidents` works afterwards; when an etcd
client is given, a copy under ``<prefix>/jobs/<job>/incidents/<id>``. The file is the record; etcd failures
are logged and do not lose it. Counters `trainwarden_hangs_total{job,node}` and
`trainwarden_incidents_total{job,node,kind}` come from `IncidentCollector`, registered on the registry the
caller passes (never the global one).
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from trainwarden.agent.proto.atomic_file import atomic_write
from trainwarden.agent.etcd.keys import DEFAULT_PREFIX, job_key
from trainwarden.agent.common.paths import default_state_home, job_state_dir

__all__ = ["DEFAULT_PREFIX", "IllegalIncidentTransition", "Incident", "IncidentCollector", "IncidentKind",
           "IncidentState", "IncidentStore", "list_incidents", "new_incident_id"]

log = logging.getLogger(__name__)



class IncidentKind(str, enum.Enum):
    HANG = "hang"
    STRAGGLER_START = "straggler_start"
    STRAGGLER_END = "straggler_end"
    CRASH = "crash"
    RESTART = "restart"


class IncidentState(str, enum.Enum):
    OPEN = "open"
    """Detected; nothing done yet."""
    ACTING = "acting"
    """An action is under way (e.g. workers aborted, waiting for the restart to progress)."""
    RESOLVED = "resolved"
    FAILED = "failed"
    """The action failed or the problem outlived it."""


_TRANSITIONS: dict[IncidentState, frozenset[IncidentState]] = {
    IncidentState.OPEN: frozenset({IncidentState.ACTING, IncidentState.RESOLVED, IncidentState.FAILED}),
    IncidentState.ACTING: frozenset({IncidentState.RESOLVED, IncidentState.FAILED}),
    IncidentState.RESOLVED: frozenset(),
    IncidentState.FAILED: frozenset(),
}


class IllegalIncidentTransition(RuntimeError):
    """A transition the lifecycle does not allow: a bug in the caller, not retryable."""


def new_incident_id(now: float | None = None) -> str:
    """Sortable unique id: ``20261122T141530123Z-3fa9c1``."""
    t = datetime.datetime.fromtimestamp(time.time() if now is None else now, tz=datetime.timezone.utc)
    return f"{t.strftime('%Y%m%dT%H%M%S')}{t.microsecond // 1000:03d}Z-{secrets.token_hex(3)}"


@dataclass(frozen=True, kw_only=True)
class Incident:
    """One incident (one version of it: see `transition`)."""

    id: str
    kind: IncidentKind
    job: str
    node: str
    ranks: tuple[int, ...] = ()
    """The ranks concerned: the culprits of a hang, the straggler."""
    evidence: Mapping[str, Any] = field(default_factory=dict)
    """JSON-serialisable facts that led to the incident."""
    detected_at: float = 0.0
    """Wall-clock time (Unix seconds)."""
    state: IncidentState = IncidentState.OPEN
    action: str = ""
    """What was done about it."""
    outcome: str = ""
    """How it ended (or why it is still open)."""
    updated_at: float = 0.0
    """Wall-clock time of the last transition."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", IncidentKind(self.kind))
        object.__setattr__(self, "state", IncidentState(self.state))
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))

    def transition(self, to: IncidentState, *, action: str | None = None, outcome: str | None = None,
                   now: float | None = None) -> "Incident":
        """The next version of this incident in state `to` (checked against the lifecycle table)."""
        to = IncidentState(to)
        if to != self.state and to not in _TRANSITIONS[self.state]:
            raise IllegalIncidentTransition(f"incident {self.id}: {self.state.value} -> {to.value} is not allowed")
        log.info("incident %s (%s, job %s): %s -> %s%s", self.id, self.kind.value, self.job, self.state.value,
                 to.value, f": {outcome}" if outcome else "")
        return dataclasses.replace(
            self, state=to, action=self.action if action is None else action,
            outcome=self.outcome if outcome is None else outcome, updated_at=time.time() if now is None else now)

    def to_json(self) -> dict:
        return {"id": self.id, "kind": self.kind.value, "job": self.job, "node": self.node,
                "ranks": list(self.ranks), "evidence": dict(self.evidence), "detected_at": self.detected_at,
                "state": self.state.value, "action": self.action, "outcome": self.outcome,
                "updated_at": self.updated_at}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Incident":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"incident record has unknown keys {unknown}; is it from a newer trainwarden?")
        return cls(**{**data, "ranks": tuple(data.get("ranks", ())), "evidence": dict(data.get("evidence") or {})})


class IncidentCollector(Collector):
    """Incident counters; `IncidentStore` counts into it, Prometheus scrapes it."""

    def __init__(self, *, node: str) -> None:
        self._node = node
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}

    def count(self, job: str, kind: IncidentKind) -> None:
        with self._lock:
            key = (job, IncidentKind(kind).value)
            self._counts[key] = self._counts.get(key, 0) + 1

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts = dict(self._counts)
        hangs = CounterMetricFamily("trainwarden_hangs", "Hangs detected by the watchdog.", labels=["job", "node"])
        incidents = CounterMetricFamily("trainwarden_incidents", "Incidents recorded, by kind.",
                                        labels=["job", "node", "kind"])
        for job in sorted({j for j, _ in counts}):
            hangs.add_metric([job, self._node], counts.get((job, IncidentKind.HANG.value), 0))
        for (job, kind), n in sorted(counts.items()):
            incidents.add_metric([job, self._node, kind], n)
        yield hangs
        yield incidents


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
        self.write_errors = 0
        """Incident versions that could not be written to the state directory (logged instead)."""

    def record(self, incident: Incident) -> Incident:
        """Store this version of `incident`; the first version of an id is counted and logged."""
        directory = Path(self._state_dir(incident.job)) / "incidents"
        data = json.dumps(incident.to_json(), indent=1, sort_keys=True, default=str)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            atomic_write(directory / f"{incident.id}.json", data.encode())
        except OSError as exc:  # a full disk must not stop the action the incident is about
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


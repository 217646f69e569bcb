"""Jobs kept in etcd, and the fleet's nodes: what `trainwarden submit/jobs/stop/resume/status/cordon` and the node
daemons read and write (DESIGN.md "etcd keys").

* ``jobs/<job>/spec``: a submitted job (``managed: true``, the ``JobSpec`` fields, who submitted it and when).
  Jobs started by hand with `trainwarden run` write their own spec there, without ``managed``: daemons leave
  those alone.
* ``jobs/<job>/state``: the job's lifecycle record (agent/common/job_lifecycle.py) with its generation. ``submit``
  and ``resume`` write a new generation in ``pending``; the launchers move it on from there.
* ``jobs/<job>/autoresume/<generation>``: a failed generation resumed by an alert (the daemon's webhook), once.
* ``jobs/<job>/control``: an operator's request to the daemons running the job, ``{"action": "stop", "generation"}``.
* ``jobs/.index/<job>``: the job's generation and what last changed it, rewritten in the same transaction by every
  request here (submit, stop, resume, refuse, an alert's resume). The node daemons watch this one small prefix
  to learn of requests at once, instead of reading every job every few seconds (agent/node/job_runner.py); no
  job name starts with a dot, so it is never taken for a job.
* ``nodes/<node>``: a daemon's record of its node (host, address, version, endpoints, jobs) under its lease.
* ``nodes/<node>/cordon``: why the node takes no new work, since when, by whom (the operator clears it).

Every write that depends on what was read is one transaction on the record's revision, so two operators (or an
operator and a launcher) cannot interleave; a refused request says why and what to do.
"""

from __future__ import annotations

import getpass
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from trainwarden.agent.common.job_lifecycle import JobPhase
from trainwarden.agent.common.job_spec import JobSpec
from trainwarden.agent.etcd.client import with_failover
from trainwarden.agent.etcd.keys import DEFAULT_PREFIX, job_key

__all__ = ["INDEX", "JobConflict", "JobControl", "JobView", "operator", "submission_record"]

_TERMINAL = {p.value for p in JobPhase if p.terminal}

INDEX = ".index"
"""``jobs/.index/<job>``: one small key per job that every request rewrites (module docstring)."""


class JobConflict(ValueError):
    """The request does not fit the job's current state (the message says what would)."""


def operator() -> str:
    """Who asks: ``user@host`` (for the records and incidents)."""
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry in a container
        user = "?"
    return f"{user}@{socket.gethostname()}"


def submission_record(spec: JobSpec, *, by: str) -> dict[str, Any]:
    """``jobs/<job>/spec`` as `submit` writes it: the spec's fields and ``SUBMISSION_KEYS``. The daemon reads it
    back with ``JobSpec.from_json`` (the same validation as `submit`)."""
    record = {**spec.to_json(), "managed": True, "submitted_by": by, "submitted_at": time.time()}
    return record


@dataclass
class JobView:
    """One job as etcd has it."""

    name: str
    spec: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    control: dict[str, Any] | None = None
    nodes: dict[str, dict] = field(default_factory=dict)
    """Live members (``jobs/<job>/nodes/<node>``): owner, address, ranks per node, phase."""
    checkpoint: dict[str, Any] | None = None
    spec_revision: int = 0
    """The etcd revision that last wrote the spec: a new one means the operator changed it."""

    @property
    def managed(self) -> bool:
        return bool(self.spec.get("managed"))

    @property
    def phase(self) -> str:
        return str(self.state.get("phase", "unknown"))

    @property
    def generation(self) -> int:
        return int(self.state.get("generation", 0))

    @property
    def stop_requested(self) -> bool:
        # a stop request holds until a submit or resume deletes it (each does, in the transaction that makes a new
        # generation): never compared with the state's generation, which a running job's launcher writes
        return (self.control or {}).get("action") == "stop"

    def job_spec(self) -> JobSpec:
        return JobSpec.from_json(self.spec, f"etcd jobs/{self.name}/spec")


class JobControl:
    """Submit, list, stop and resume jobs; cordon and uncordon nodes (module docstring)."""

    def __init__(self, client, *, prefix: str = DEFAULT_PREFIX) -> None:
        self._client, self._prefix = client, prefix

    @property
    def client(self):
        return self._client

    def _key(self, job: str, *parts: str) -> str:
        return job_key(job, *parts, prefix=self._prefix)

    def key(self, job: str, *parts: str) -> str:
        """``<prefix>/jobs/<job>/<parts...>``."""
        return self._key(job, *parts)

    def node_key(self, node: str, *parts: str) -> str:
        return "/".join([self._prefix.rstrip("/"), "nodes", node, *parts])

    def _get(self, key: str) -> tuple[dict | None, Any]:
        client = self._client
        value, meta = with_failover(client, lambda: client.get(key))
        if value is None:
            return None, None
        try:
            return json.loads(value), meta
        except ValueError:
            return {"unreadable": value[:200].decode(errors="replace")}, meta

    def _txn(self, compare, success) -> bool:
        client = self._client
        ok, _ = with_failover(client, lambda: client.transaction(compare=compare, success=success, failure=[]))
        return bool(ok)

    def _unchanged(self, key: str, meta) -> list:
        txn = self._client.transactions
        return [txn.version(key) == 0] if meta is None else [txn.mod(key) == meta.mod_revision]

    def index_key(self, job: str = "") -> str:
        """``jobs/.index/<job>``; with no job, the index's prefix (trailing slash)."""
        return self._key(INDEX, job)

    def _indexed(self, name: str, generation: int, why: str):
        """The transaction's put of ``name``'s index entry (every request's transaction carries one)."""
        return self._client.transactions.put(self.index_key(name), json.dumps(
            {"generation": generation, "why": why, "at": time.time()}, sort_keys=True))

    def index(self) -> dict[str, int]:
        """Every indexed job with the revision that last changed its entry (one range read of small keys)."""
        client, root = self._client, self.index_key()
        return {meta.key.decode()[len(root):]: int(meta.mod_revision)
                for _, meta in with_failover(client, lambda: list(client.get_prefix(root, keys_only=True)))}

    def ensure_indexed(self, view: "JobView") -> bool:
        """Index a job submitted before the index existed (created only if absent); True if it was written."""
        key = self.index_key(view.name)
        txn = self._client.transactions
        return self._txn([txn.version(key) == 0], [self._indexed(view.name, view.generation, "indexed")])

    def members(self, name: str) -> dict[str, dict]:
        """The job's live members (``jobs/<job>/nodes/<node>``), by node."""
        client, root = self._client, self._key(name, "nodes", "")
        found = {}
        for value, meta in with_failover(client, lambda: list(client.get_prefix(root))):
            try:
                found[meta.key.decode()[len(root):]] = json.loads(value)
            except ValueError:
                continue
        return found

    # ---- jobs -------------------------------------------------------------------------------------------

    def submit(self, spec: JobSpec, *, by: str | None = None) -> int:
        """Record ``spec`` and a new generation in ``pending``; the generation. Refused while the job runs."""
        state_key, spec_key = self._key(spec.name, "state"), self._key(spec.name, "spec")
        state, meta = self._get(state_key)
        phase = (state or {}).get("phase")
        if state is not None and phase not in _TERMINAL:
            raise JobConflict(f"job {spec.name} is {phase} (generation {state.get('generation', 0)}); stop it first "
                              f"(trainwarden stop {spec.name}) or submit under another name")
        generation = int((state or {}).get("generation", 0)) + 1
        record = submission_record(spec, by=by or operator())
        txn = self._client.transactions
        if not self._txn(self._unchanged(state_key, meta), [
                txn.put(spec_key, json.dumps(record, sort_keys=True)),
                txn.put(state_key, json.dumps(_pending(spec.name, generation, "submitted by " + record["submitted_by"]))),
                txn.delete(self._key(spec.name, "control")),
                self._indexed(spec.name, generation, "submitted")]):
            raise JobConflict(f"job {spec.name} changed while it was being submitted; look at `trainwarden jobs` and "
                              "try again")
        return generation

    def job(self, name: str, *, members: bool = True) -> JobView | None:
        """One job; without ``members`` only its spec, state and control (what a daemon decides from: three
        small reads, none that grows with the job's nodes)."""
        view = self._view(name, members=members)
        return view if view.spec or view.state else None

    def jobs(self) -> list[JobView]:
        """Every job with a spec or state. The names come from a keys-only scan (a job's incidents and
        rendezvous data are never read), then each job's few records."""
        client, root = self._client, self._key("", "")[:-1]  # ".../jobs/"
        names = set()
        for _, meta in with_failover(client, lambda: list(client.get_prefix(root, keys_only=True))):
            name, _, part = meta.key.decode()[len(root):].partition("/")
            if part in ("spec", "state") and not name.startswith("."):  # not the index
                names.add(name)
        return [view for view in (self._view(n) for n in sorted(names)) if view.spec or view.state]

    def _view(self, name: str, *, members: bool = True) -> JobView:
        view = JobView(name)
        spec, meta = self._get(self._key(name, "spec"))
        view.spec, view.spec_revision = spec or {}, int(meta.mod_revision) if meta is not None else 0
        view.state = self._get(self._key(name, "state"))[0] or {}
        view.control = self._get(self._key(name, "control"))[0]
        if members:
            view.checkpoint = self._get(self._key(name, "checkpoint"))[0]
            view.nodes = self.members(name)
        return view

    def stop(self, name: str, *, by: str | None = None) -> str:
        """Ask every node running the job to stop it; what happens, in words."""
        by = by or operator()
        state_key = self._key(name, "state")
        state, meta = self._get(state_key)
        if state is None:
            raise JobConflict(f"no job {name} in etcd; `trainwarden jobs` lists them")
        phase, generation = state.get("phase"), int(state.get("generation", 0))
        if phase in _TERMINAL:
            raise JobConflict(f"job {name} already {phase} (generation {generation}); nothing to stop")
        request = json.dumps({"action": "stop", "generation": generation, "by": by, "at": time.time()})
        txn = self._client.transactions
        success = [txn.put(self._key(name, "control"), request), self._indexed(name, generation, "stop")]
        if phase == JobPhase.PENDING.value:  # no launcher has it yet: stopped here and now
            success.append(txn.put(state_key, json.dumps({**state, "phase": JobPhase.STOPPED.value,
                                                          "reason": f"stopped by {by} before it started",
                                                          "last_change": time.time()})))
        if not self._txn(self._unchanged(state_key, meta), success):
            raise JobConflict(f"job {name} changed meanwhile; run `trainwarden stop {name}` again")
        if phase == JobPhase.PENDING.value:
            return f"job {name} stopped before it started (generation {generation})"
        return f"asked the nodes running job {name} to stop it (generation {generation}, {phase})"

    def refuse(self, name: str, generation: int, reason: str) -> bool:
        """Move the pending ``generation`` to ``refused`` with ``reason`` (one transaction on the state's
        revision); False when it is no longer pending in that generation (started, stopped or refused meanwhile)."""
        state_key = self._key(name, "state")
        state, meta = self._get(state_key)
        if (state or {}).get("phase") != JobPhase.PENDING.value or int(state.get("generation", 0)) != generation:
            return False
        refused = {**state, "phase": JobPhase.REFUSED.value, "reason": reason[:500], "last_change": time.time()}
        put = self._client.transactions.put(state_key, json.dumps(refused))
        return self._txn(self._unchanged(state_key, meta), [put, self._indexed(name, generation, "refused")])

    def resume(self, name: str, *, by: str | None = None) -> int:
        """Start a failed or stopped submitted job again as the next generation; the generation."""
        by = by or operator()
        view = self.job(name)
        if view is None or not view.state:
            raise JobConflict(f"no job {name} in etcd; `trainwarden jobs` lists them")
        if not view.managed:
            raise JobConflict(f"job {name} was started by hand with `trainwarden run`, not submitted: run that "
                              "command again to resume it")
        if view.phase == JobPhase.SUCCEEDED.value:
            raise JobConflict(f"job {name} succeeded; submit it again to run it again")
        if view.phase not in _TERMINAL:
            raise JobConflict(f"job {name} is {view.phase}, not failed or stopped: nothing to resume")
        state_key = self._key(name, "state")
        _, meta = self._get(state_key)
        generation = view.generation + 1
        txn = self._client.transactions
        if not self._txn(self._unchanged(state_key, meta), [
                txn.put(state_key, json.dumps(_pending(name, generation, f"resumed by {by} after {view.phase}"))),
                txn.delete(self._key(name, "control")),
                self._indexed(name, generation, "resumed")]):
            raise JobConflict(f"job {name} changed meanwhile; run `trainwarden resume {name}` again")
        return generation

    def resume_once(self, name: str, generation: int, *, by: str, record: dict[str, Any]) -> int:
        """Resume the failed generation ``generation`` of a submitted job at most once, however many callers ask
        (Alertmanager repeats its notifications; several daemons may receive them): one transaction finds the
        state unchanged and ``jobs/<job>/autoresume/<generation>`` absent, writes the next generation in
        ``pending`` and that key (``record`` plus the time). The new generation; ``JobConflict`` otherwise."""
        state_key, once_key = self._key(name, "state"), self._key(name, "autoresume", f"{generation:08d}")
        state, meta = self._get(state_key)
        if state is None or int(state.get("generation", 0)) != generation:
            raise JobConflict(f"job {name} is no longer in generation {generation}")
        if state.get("phase") != JobPhase.FAILED.value:
            raise JobConflict(f"job {name} is {state.get('phase')}, not failed")
        txn = self._client.transactions
        entry = {**record, "at": time.time(), "by": by, "generation": generation, "resumed_as": generation + 1}
        if not self._txn([*self._unchanged(state_key, meta), txn.version(once_key) == 0], [
                txn.put(state_key, json.dumps(_pending(name, generation + 1, f"resumed by {by} after failed"))),
                txn.put(once_key, json.dumps(entry, sort_keys=True)),
                txn.delete(self._key(name, "control")),
                self._indexed(name, generation + 1, "resumed by an alert")]):
            raise JobConflict(f"job {name} generation {generation} was resumed meanwhile")
        return generation + 1

    def auto_resumes(self, name: str) -> list[dict[str, Any]]:
        """The job's automatic resumes (``resume_once``), oldest first."""
        client, root = self._client, self._key(name, "autoresume", "")
        found = []
        for value, _ in with_failover(client, lambda: list(client.get_prefix(root, sort_order="ascend"))):
            try:
                found.append(json.loads(value))
            except ValueError:
                continue
        return found

    # ---- nodes ------------------------------------------------------------------------------------------

    def cordon(self, node: str, reason: str, *, by: str | None = None, drain: bool = False) -> None:
        """No new work on ``node``; with ``drain``, its daemon also takes it out of the jobs it runs (each
        leaves at a step boundary after a checkpoint: no step lost)."""
        record = {"reason": reason, "since": time.time(), "by": by or operator(), "drain": drain}
        client = self._client
        with_failover(client, lambda: client.put(self.node_key(node, "cordon"), json.dumps(record)))

    def uncordon(self, node: str) -> bool:
        client = self._client
        return bool(with_failover(client, lambda: client.delete(self.node_key(node, "cordon"))))

    def cordoned(self, node: str) -> dict | None:
        return self._get(self.node_key(node, "cordon"))[0]

    def nodes(self) -> dict[str, dict]:
        """Every node's record and cordon, by node name: ``{"record": ..., "cordon": ...}``."""
        client = self._client
        root = self.node_key("")
        found: dict[str, dict] = {}
        for value, meta in with_failover(client, lambda: list(client.get_prefix(root))):
            name, _, part = meta.key.decode()[len(root):].partition("/")
            try:
                data = json.loads(value)
            except ValueError:
                continue
            found.setdefault(name, {"record": None, "cordon": None})["cordon" if part == "cordon" else "record"] = data
        return found


def _pending(job: str, generation: int, reason: str) -> dict[str, Any]:
    return {"job": job, "phase": JobPhase.PENDING.value, "generation": generation, "restarts": 0,
            "last_change": time.time(), "reason": reason, "owner": {}}

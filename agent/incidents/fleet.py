"""The fleet's incidents, read from etcd: every node's copy under ``<prefix>/jobs/<job>/incidents/<id>``.

Each agent's ``IncidentStore`` (store.py) writes its incidents to its own state directory and mirrors them to etcd;
this reads the mirror, so `trainwarden incidents --etcd` shows a job's incidents from every node in one list, merged
by the time they were detected (then by id, which is itself time-ordered and unique across agents). The names
of the jobs come from a keys-only scan of ``<prefix>/jobs/``; only the jobs' ``incidents/`` prefixes are read.
A record that does not parse is skipped with a warning, never a reason to show nothing.
"""

from __future__ import annotations

import json
import logging

from trainwarden.agent.etcd.keys import DEFAULT_PREFIX, job_key
from trainwarden.agent.incidents.record import Incident

__all__ = ["fleet_incidents"]

log = logging.getLogger(__name__)


def fleet_incidents(client, *, job: str | None = None, prefix: str = DEFAULT_PREFIX) -> list[Incident]:
    """The incidents of ``job`` (every job's when None) that etcd holds, from every node, oldest first.
    ``client``: an etcd3 client; its errors (etcd away, a refused permission) are the caller's to report."""
    from trainwarden.agent.etcd.client import with_failover

    jobs = [job] if job is not None else _jobs_with_incidents(client, prefix)
    found = []
    for name in jobs:
        root = job_key(name, "incidents", "", prefix=prefix)
        for value, meta in with_failover(client, lambda: list(client.get_prefix(root))):
            try:
                found.append(Incident.from_json(json.loads(value)))
            except (ValueError, TypeError) as exc:
                log.warning("skipping unreadable incident %s in etcd: %s", meta.key.decode(errors="replace"), exc)
    return sorted(found, key=lambda i: (i.detected_at, i.id))


def _jobs_with_incidents(client, prefix: str) -> list[str]:
    from trainwarden.agent.etcd.client import with_failover

    root = job_key("", "", prefix=prefix)[:-1]  # ".../jobs/"
    names = set()
    for _, meta in with_failover(client, lambda: list(client.get_prefix(root, keys_only=True))):
        name, _, rest = meta.key.decode()[len(root):].partition("/")
        if rest.startswith("incidents/"):
            names.add(name)
    return sorted(names)

"""``node_lost``: a node of a multi-node job stopped renewing its membership lease (power loss, kill, cut off).

When a node dies its workers' peers on the other nodes only see connections reset: their crash or restart
incident can say "the failed rank is on another node", not which. The node's membership record
(``jobs/<job>/nodes/<node>``, agent/etcd/membership.py) says which: it lives under a lease the node keeps
alive, and etcd deletes it when the lease ends. ``NodeLossWatcher`` runs on every node of the job, reads the
records every ``period_s`` and, when a member it saw is gone without having said it departed
(``mark_departed``: a node that stops on purpose), races the other survivors for the loss
(``claim_node_loss``): the one that wins records ONE ``node_lost`` incident for the job, naming the node,
its ranks in its last worker round (the record's ``ranks``) and when its lease ended (between the last
read that saw it and the one that did not; its last keep-alive was up to one lease TTL before).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from trainwarden.agent.etcd.client import describe_etcd_error
from trainwarden.agent.etcd.keys import DEFAULT_PREFIX
from trainwarden.agent.etcd.membership import MEMBERSHIP_TTL_S, claim_node_loss, departed, member_records
from trainwarden.agent.incidents.record import Incident, IncidentKind, IncidentState, new_incident_id

__all__ = ["NodeLossWatcher"]

log = logging.getLogger(__name__)


class NodeLossWatcher:
    """Records one ``node_lost`` incident per lost member of ``job``, from whichever survivor sees it first."""

    def __init__(self, client, job: str, node: str, record: Callable[[Incident], Incident], *,
                 prefix: str = DEFAULT_PREFIX, period_s: float = 1.0, lease_ttl_s: float = MEMBERSHIP_TTL_S,
                 wall: Callable[[], float] = time.time) -> None:
        self._client, self._job, self._node, self._record = client, job, node, record
        self._prefix, self._period, self._ttl, self._wall = prefix, period_s, lease_ttl_s, wall
        self._seen: dict[str, tuple[dict, str, float]] = {}  # node -> (record, create revision, last seen)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="trainwarden-node-loss", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 3.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def check_once(self) -> list[Incident]:
        """Read the members once; the incidents this node recorded (raises on etcd errors)."""
        now = self._wall()
        live = member_records(self._client, self._job, prefix=self._prefix)
        gone = {name: seen for name, seen in self._seen.items() if name != self._node and (
            name not in live or live[name][0].get("owner") != seen[0].get("owner"))}  # or a new run replaced it
        self._seen = {name: (rec, rev, now) for name, (rec, rev) in live.items()}
        recorded = []
        for name, (rec, rev, last_seen) in sorted(gone.items()):
            if departed(self._client, self._job, name, prefix=self._prefix):
                continue
            if claim_node_loss(self._client, self._job, name, rev, self._node, prefix=self._prefix):
                recorded.append(self._record(self._incident(name, rec, last_seen, now)))
        return recorded

    def _incident(self, lost: str, rec: dict, last_seen: float, now: float) -> Incident:
        ranks = tuple(sorted(int(r) for r in rec.get("ranks") or ()))
        when = time.strftime("%H:%M:%S", time.localtime(now))
        which = f"ranks {','.join(map(str, ranks))}" if ranks else "its ranks unknown"
        return Incident(
            id=new_incident_id(now), kind=IncidentKind.NODE_LOST, job=self._job, node=lost, ranks=ranks,
            evidence={"lost_node": lost, "ranks_in_last_round": list(ranks), "round": rec.get("round"),
                      "address": rec.get("address"), "lease_ended_after": round(last_seen, 3),
                      "lease_ended_by": round(now, 3), "lease_ttl_s": self._ttl, "recorded_by": self._node,
                      "summary": f"node {lost} ({which}) stopped renewing its membership: its lease ended by "
                                 f"{when} (its last keep-alive was up to {self._ttl:.0f} s earlier)"},
            detected_at=now, state=IncidentState.RESOLVED,
            action="none here: the surviving nodes' workers fail and torchrun regroups them without it",
            outcome="the job goes on without the node")

    def _run(self) -> None:
        failing = False
        while not self._stop.wait(self._period):
            try:
                self.check_once()
                failing = False
            except Exception as exc:  # an etcd outage costs visibility, never the run
                if not failing:
                    log.warning("cannot read job %s's members in etcd (%s); retrying", self._job,
                                describe_etcd_error(exc))
                failing = True

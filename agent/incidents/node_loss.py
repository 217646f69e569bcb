"""``node_lost``: a node of a multi-node job stopped renewing its membership lease (power loss, kill, cut off).

When a node dies its workers' peers on the other nodes only see connections reset: their crash or restart
incident can say "the failed rank is on another node", not which. The node's membership record
(``jobs/<job>/nodes/<node>``, agent/etcd/membership.py) says which: it lives under a lease the node keeps
alive, and etcd deletes it when the lease ends. ``NodeLossWatcher`` runs on every node of the job, watches the
records (one etcd watch on ``jobs/<job>/nodes/``: a quiet job costs etcd nothing, where reading every member every
second cost each node O(nodes) a second, the whole job O(nodes²)) and, when a member it saw is gone without having
said it departed
(``mark_departed``: a node that stops on purpose), races the other survivors for the loss
(``claim_node_loss``): the one that wins records ONE ``node_lost`` incident for the job, naming the node,
its ranks in its last worker round (the record's ``ranks``) and when its lease ended (between the last
read that saw it and the one that did not; its last keep-alive was up to one lease TTL before).

The watch is checked every ``period_s`` without asking etcd (agent/etcd/watch.py); when it is gone (python3-etcd3
drops it silently with its stream) the members are read again (``check_once``) and watched anew; every
``SAFETY_REREAD_S`` they are counted (one count-only read) and read again only if the count is not the watch's.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable

from trainwarden.agent.etcd.client import describe_etcd_error, with_failover
from trainwarden.agent.etcd.keys import DEFAULT_PREFIX
from trainwarden.agent.etcd.membership import (MEMBERSHIP_TTL_S, claim_node_loss, departed, member_records,
                                               nodes_prefix)
from trainwarden.agent.etcd.watch import KeyWatch
from trainwarden.agent.incidents.record import Incident, IncidentKind, IncidentState, new_incident_id

__all__ = ["NodeLossWatcher", "SAFETY_REREAD_S"]

SAFETY_REREAD_S = 60.0
"""How often the members are counted although the watch lives: the net under a watch that died unseen. A loss is
then recorded within this long at worst (normally within the lease's end and an event's delivery). A count, not a
read: reading every member's record each minute on every node would be O(nodes²) again, only slower."""

log = logging.getLogger(__name__)


class NodeLossWatcher:
    """Records one ``node_lost`` incident per lost member of ``job``, from whichever survivor sees it first."""

    def __init__(self, client, job: str, node: str, record: Callable[[Incident], Incident], *,
                 prefix: str = DEFAULT_PREFIX, period_s: float = 1.0, lease_ttl_s: float = MEMBERSHIP_TTL_S,
                 wall: Callable[[], float] = time.time, clock: Callable[[], float] = time.monotonic) -> None:
        """``period_s``: how often the watch is checked (locally); etcd is read only when it is gone."""
        self._client, self._job, self._node, self._record = client, job, node, record
        self._prefix, self._period, self._ttl, self._wall, self._clock = prefix, period_s, lease_ttl_s, wall, clock
        self._seen: dict[str, tuple[dict, str, float]] = {}  # node -> (record, create revision, last seen)
        self._live: dict[str, tuple[dict, str]] = {}  # the members as the watch has them
        self._lock = threading.Lock()
        self._dirty = False
        self._watch: KeyWatch | None = None
        self._read_at: float | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="trainwarden-node-loss", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 3.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._watch is not None:
            self._watch.stop()

    def check_once(self) -> list[Incident]:
        """Read the members once; the incidents this node recorded (raises on etcd errors)."""
        live = member_records(self._client, self._job, prefix=self._prefix)
        with self._lock:
            self._live, self._dirty = dict(live), False
        return self._compare(live)

    def _watch_and_read(self) -> list[Incident]:
        if self._watch is not None:
            self._watch.stop()
        self._watch = KeyWatch(self._client, nodes_prefix(self._job, self._prefix), self._on_events, prefix=True,
                               on_error=lambda exc: self._wake.set())
        self._watch.start()  # before the read: nothing changes unseen between the two
        recorded = self.check_once()
        self._read_at = self._clock()
        return recorded

    def _recount(self) -> None:
        """The safety net, cheaply: count the members (a count-only read); read them all only if the count is not
        the watch's."""
        client, base = self._client, nodes_prefix(self._job, self._prefix)
        count = int(with_failover(client, lambda: client.get_prefix_response(base, count_only=True)).count)
        with self._lock:
            known = len(self._live)
        if count != known:
            log.info("job %s: %d members in etcd, %d as watched; reading them again", self._job, count, known)
            self._watch_and_read()
        self._read_at = self._clock()

    def _on_events(self, events: list) -> None:
        """The watch thread's part: the members as the events say (no etcd call here)."""
        base = nodes_prefix(self._job, self._prefix)
        with self._lock:
            for event in events:
                name = event.key.decode()[len(base):]
                if type(event).__name__ == "DeleteEvent":
                    self._live.pop(name, None)
                    continue
                try:
                    record = json.loads(event.value)
                except (TypeError, ValueError):
                    record = {}
                self._live[name] = (record if isinstance(record, dict) else {}, str(event.create_revision))
            self._dirty = True
        self._wake.set()

    def _compare(self, live: dict[str, tuple[dict, str]]) -> list[Incident]:
        now = self._wall()
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
        while not self._stop.is_set():
            self._wake.clear()
            try:
                if self._watch is None or not self._watch.alive() or self._read_at is None:
                    self._watch_and_read()
                elif self._clock() - self._read_at >= SAFETY_REREAD_S:
                    self._recount()
                elif self._dirty:
                    with self._lock:
                        live, self._dirty = dict(self._live), False
                    self._compare(live)
                failing = False
            except Exception as exc:  # an etcd outage costs visibility, never the run
                if not failing:
                    log.warning("cannot read job %s's members in etcd (%s); retrying", self._job,
                                describe_etcd_error(exc))
                failing = True
            self._wake.wait(self._period)  # an event wakes it at once

"""A hot spare names itself in the ``node_lost`` incident of the node whose ranks it took (issue 47).

With ``--spare-nodes K`` a spare waits in the job's rendezvous; when a training node is lost, the next round
gives the spare the lost node's position, so its workers get the lost node's global ranks
(agent/rendezvous/native.py, **Ranks**). The survivor that saw the loss recorded ``node_lost`` (node_loss.py)
from the lost node's membership record: its ranks and its last round. When the spare's first round starts, it
looks for that incident — another node, the same ranks, lost in the round before this one — and records the
incident's next version, which says "node n2 lost; spare n3 took ranks 2,3". The survivor records the loss
when the lost node's membership lease ends (``MEMBERSHIP_TTL_S``), which may be after the new round started:
the spare looks again every ``poll_s`` for ``wait_s``.

A node that a policy excluded (``--straggler-policy exclude``, ``--link-policy exclude``) or that was drained
(SIGUSR1) is not lost: it leaves at an agreed step (agent/launch/regroup.py) and says so in the round's leave record
(``jobs/<job>/leave/<round>``: its node, step, ranks and ``cause``: ``excluded`` or ``drain``). A spare whose first
round follows such a leave, with the leaver's ranks, records a ``spare_swap`` incident: "node n1 excluded (link
check: ...); spare n2 took ranks 2,3 after step 40" or "node n1 drained; spare n2 took ranks 2,3 after step 40",
and counts the swap as ``excluded`` or ``drained``.

Nothing here decides anything: the incident only tells who took the ranks. No torch here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import Callable, Iterable

from trainwarden.agent.etcd.client import describe_etcd_error, with_failover
from trainwarden.agent.etcd.cluster import read_leave
from trainwarden.agent.etcd.keys import DEFAULT_PREFIX, job_key
from trainwarden.agent.incidents.record import Incident, IncidentKind, IncidentState, new_incident_id

__all__ = ["LEAVE_SWAP_CAUSES", "SpareTakeover", "taken_over", "took_left"]

log = logging.getLogger(__name__)


def taken_over(incidents: Iterable[Incident], *, node: str, round_: int, ranks: tuple[int, ...]) -> Incident | None:
    """The ``node_lost`` incident whose ranks ``node`` took in round ``round_``: another node with exactly these
    ranks, lost in the round before, and no spare named yet; None if there is none."""
    for incident in incidents:
        evidence = incident.evidence
        if (incident.kind == IncidentKind.NODE_LOST and incident.node != node and incident.ranks == ranks
                and evidence.get("round") == round_ - 1 and not evidence.get("spare")):
            return incident
    return None


LEAVE_SWAP_CAUSES = {"excluded": "excluded", "drain": "drained"}
"""A leave record's cause (agent/etcd/cluster.py ``LEAVE_CAUSES``) -> the swap's cause (agent/launch/spare_swaps.py)."""


def took_left(leave: dict | None, *, node: str, ranks: tuple[int, ...]) -> str | None:
    """The swap's cause (``excluded``, ``drained``) if ``leave`` (the round before's leave record, ``read_leave``) is
    another node's leave whose ranks ``node`` now holds; else None."""
    if not leave or leave.get("node") == node or tuple(leave.get("ranks") or ()) != ranks:
        return None
    return LEAVE_SWAP_CAUSES.get(leave.get("cause"))


class SpareTakeover:
    """On a node of a job with spares: after each worker round starts, names this node in the loss it replaced."""

    def __init__(self, client, job: str, node: str, record: Callable[[Incident], Incident], *,
                 prefix: str = DEFAULT_PREFIX, wait_s: float = 30.0, poll_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_swap: Callable[[str, Incident], None] | None = None) -> None:
        """``on_swap(cause, incident)``: told once this node named itself in the loss (``node_lost``), the
        exclusion (``excluded``) or the drain (``drained``) it replaced (the metrics count the swap: agent/launch/spare_swaps.py)."""
        self._client, self._job, self._node, self._record = client, job, node, record
        self._on_swap = on_swap
        self._prefix, self._wait_s, self._poll_s, self._clock = prefix, wait_s, poll_s, clock
        self._ranks: tuple[int, ...] | None = None
        self._stop = threading.Event()

    def round_started(self, round_: int | None, ranks: Iterable[int]) -> None:
        """This node's workers started in ``round_`` with ``ranks``: if those are new to it (a spare's first round,
        or ranks that moved to it), look for the loss it replaced, on a thread of its own."""
        ranks = tuple(sorted(int(r) for r in ranks))
        before, self._ranks = self._ranks, ranks
        if round_ is None or round_ < 1 or not ranks or ranks == before:
            return  # a survivor keeps its ranks, and a job's first round follows no loss: it replaced nobody
        threading.Thread(target=self._name_spare, args=(int(round_), ranks), name="trainwarden-spare-takeover",
                         daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _name_spare(self, round_: int, ranks: tuple[int, ...]) -> Incident | None:
        deadline = self._clock() + self._wait_s
        while not self._stop.is_set():
            named, cause = None, "node_lost"
            try:
                leave = read_leave(self._client, self._job, str(round_ - 1), prefix=self._prefix)
                left = took_left(leave, node=self._node, ranks=ranks)
                if left is not None:
                    named, cause = self._record(self._left(leave, left, round_, ranks)), left
                else:
                    lost = taken_over(self._incidents(), node=self._node, round_=round_, ranks=ranks)
                    named = self._record(self._named(lost, round_, ranks)) if lost is not None else None
            except Exception as exc:  # etcd away: try again until the deadline
                log.debug("cannot read job %s's leave record or incidents: %s", self._job, describe_etcd_error(exc))
            if named is not None:
                if self._on_swap is not None:
                    try:
                        self._on_swap(cause, named)
                    except Exception:  # noqa: BLE001 - a listener's error is not the incident's
                        log.exception("job %s: the spare swap's listener failed", self._job)
                return named
            if self._clock() >= deadline or self._stop.wait(self._poll_s):
                return None
        return None

    def _named(self, lost: Incident, round_: int, ranks: tuple[int, ...]) -> Incident:
        which = ",".join(map(str, ranks))
        evidence = {**lost.evidence, "spare": self._node, "spare_round": round_,
                    "summary": f"node {lost.node} lost; spare {self._node} took ranks {which} "
                               f"({lost.evidence.get('summary', '')})"}
        return dataclasses.replace(lost, evidence=evidence, updated_at=time.time(),
                                   outcome=f"spare {self._node} took ranks {which} in round {round_}: the job goes on "
                                           "at the same world size")

    def _left(self, leave: dict, cause: str, round_: int, ranks: tuple[int, ...]) -> Incident:
        which, now = ",".join(map(str, ranks)), time.time()
        why = f" ({leave['reason']})" if leave.get("reason") else ""
        return Incident(
            id=new_incident_id(now), kind=IncidentKind.SPARE_SWAP, job=self._job, node=leave["node"], ranks=ranks,
            evidence={"left_node": leave["node"], "cause": cause, "reason": leave.get("reason", ""),
                      "step": leave["step"], "round": round_ - 1, "spare": self._node, "spare_round": round_,
                      "summary": f"node {leave['node']} {cause}{why}; spare {self._node} took ranks {which} after "
                                 f"step {leave['step']}"},
            detected_at=now, state=IncidentState.RESOLVED,
            action=f"node {leave['node']} left after the checkpoint of step {leave['step']}",
            outcome=f"spare {self._node} took ranks {which} in round {round_}: the job goes on at the same world size")

    def _incidents(self) -> list[Incident]:
        base = job_key(self._job, "incidents", "", prefix=self._prefix)
        found = []
        for value, _ in with_failover(self._client, lambda: list(self._client.get_prefix(base))):
            try:
                found.append(Incident.from_json(json.loads(value)))
            except (TypeError, ValueError):
                continue  # a record of another release, or not an incident: not ours to name
        return found

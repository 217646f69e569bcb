"""Verdicts that reach a hang's owner after it recorded the hang (agent/watchdog/loop.py feeds it).

The node that owns a hang (agent/etcd/cluster.py `HangCoordinator`) waits `verdict_wait_s` for the other live
nodes' verdicts, then records the incident with those it has. A node can judge later than that: its ranks were
leaving a checkpoint save when the job stalled (leaving the stage is progress, so its deadline starts again), or
its watchdog saw the stall a check later. Its verdict still reaches etcd (under the hang's key, for
``HANG_KEY_TTL_S``), but the incident said "node n1 did not answer" and named no rank: in the soak's hour (session
33) a SIGSTOP of rank 6 on n1 while n1 finished a save was recorded by n0 that way, and n1's verdict, "rank 6 is
stopped", came 7 s later. For ``LATE_VERDICT_S`` after a hang recorded without every node's verdict the owner reads
the verdicts again at each check; when one that was missing names a culprit, the incident's latest version gets the
culprits, the merged summary and the verdicts (``late_verdicts``: the nodes that answered late), whatever its
state by then. One read of the hang's verdicts per check, only while such a hang is that recent.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

from trainwarden.agent.etcd.cluster import merge_verdicts
from trainwarden.agent.incidents import Incident

__all__ = ["LATE_VERDICT_S", "LateVerdicts"]

log = logging.getLogger("trainwarden.agent.watchdog.loop")  # the watchdog's log

LATE_VERDICT_S = 15.0
"""How long after recording a hang its owner looks for the verdicts it did not get (the verdicts' own TTL)."""


@dataclass
class _Pending:
    incident: Incident  # its latest version
    key: str
    silent: set[str]
    verdicts: dict[str, dict]
    until: float


class LateVerdicts:
    """The owner's hangs recorded without every live node's verdict (module docstring); not thread-safe."""

    def __init__(self, read: Callable[[str, str], dict[str, dict]], record: Callable[[Incident], Incident], *,
                 clock: Callable[[], float], wall: Callable[[], float]) -> None:
        """``read(job, key)``: the verdicts now under the hang's key, by node."""
        self._read, self._record, self._clock, self._wall = read, record, clock, wall
        self._pending: dict[str, _Pending] = {}

    def await_(self, incident: Incident, key: str, silent: list[str], verdicts: dict[str, dict]) -> None:
        """``incident`` was recorded with ``verdicts`` while ``silent`` had given none."""
        if silent:
            self._pending[incident.job] = _Pending(incident, key, set(silent), dict(verdicts),
                                                   self._clock() + LATE_VERDICT_S)

    def updated(self, incident: Incident) -> None:
        """A later version of a hang incident was recorded (its transitions): amendments go on top of it."""
        pending = self._pending.get(incident.job)
        if pending is not None and pending.incident.id == incident.id:
            pending.incident = incident

    def check(self, job: str) -> Incident | None:
        """Read the verdicts of ``job``'s pending hang; the amended version when a late one named a culprit."""
        pending = self._pending.get(job)
        if pending is None:
            return None
        if self._clock() > pending.until:
            del self._pending[job]
            return None
        try:
            now_in = self._read(job, pending.key)
        except Exception as exc:  # etcd away: the incident stays as recorded
            log.debug("job %s: cannot read the hang's late verdicts (%s)", job, exc)
            return None
        late = {node: v for node, v in now_in.items() if node in pending.silent}
        if not late:
            return None
        pending.silent -= set(late)
        pending.verdicts.update(late)
        if not pending.silent:
            del self._pending[job]
        named, summary = merge_verdicts(pending.verdicts)
        if not named:
            return None
        old = pending.incident
        cluster = dict(old.evidence.get("cluster") or {})
        cluster.update(verdicts=dict(pending.verdicts), culprit_nodes={str(r): n for r, n in named.items()},
                       silent_nodes=sorted(pending.silent),
                       late_verdicts=sorted(set(late) | set(cluster.get("late_verdicts") or ())))
        amended = self._record(dataclasses.replace(
            old, ranks=tuple(sorted(named)), updated_at=self._wall(),
            evidence={**old.evidence, "cluster": cluster, "summary": summary}))
        log.warning("job %s: the hang %s names %s after node %s's late verdict: %s", job, old.id,
                    ", ".join(f"rank {r} on {n}" for r, n in sorted(named.items())), ",".join(sorted(late)),
                    summary, extra={"job": job, "incident": old.id})
        if job in self._pending:
            self._pending[job].incident = amended
        return amended

    def forget(self, job: str) -> None:
        self._pending.pop(job, None)

"""What the node agents of a multi-node job tell each other through etcd: progress, and who acts on a hang.

* **Progress** (``ProgressPublisher``, on a thread of its own every ``PROGRESS_PERIOD_S``): per job with ranks on this
  node, ``jobs/<job>/progress/<node>`` = this node's ranks with their last step, whether their telemetry
  stream is connected, and the time of the summary; under a lease of the publisher's, so a dead node's
  summary goes by itself. A summary older than two periods, or none, says the node's agent is silent.
* **Hangs** (``HangCoordinator``). In synchronous training a hang stops every rank, so every node's watchdog
  detects it, within a second or so of the others (they share the deadline rule and the stall's start).
  Each names what it can from its own ranks' Flight Recorder dumps: the node that holds the culprit names it
  (its rank lags its local peers' sequence ids); the others see only ranks waiting inside a collective.
  Each node writes that local verdict to ``jobs/<job>/hangs/<key>/verdicts/<node>``, then tries to create
  ``jobs/<job>/hangs/<key>/owner`` in a transaction: the one node that does records the hang incident, after
  waiting a few seconds for the verdicts of the job's other live nodes, and names the culprit rank and its
  node from all of them; the others record nothing and only abort their own workers (every node must, for
  the group to restart). ``key`` is the last step completed before the stall, which every node of a
  synchronous job sees alike. The keys live under a short lease, so the same step hanging again after the
  restart is a new incident.

* **Working elsewhere** (``HangCoordinator.set_busy``, ``busy_elsewhere``). A node sees only its own ranks' activity:
  while rank 0 evaluates alone on one node, the ranks of every other node wait in a collective and look hung
  there. So a node whose ranks work while the job is stalled says so in ``jobs/<job>/busy/<node>`` (put when it
  starts, deleted when it stops, under a lease of ``BUSY_TTL_S`` kept alive meanwhile: a dead agent's beacon goes
  by itself), and a node whose watchdog would declare a hang first reads ``jobs/<job>/busy/``: while another node
  works, it is not a hang yet. Nothing is written while the job progresses or while no rank works (a real hang).
* **Slow off the links elsewhere** (``HangCoordinator.set_slow_off_links``, ``slow_off_links_elsewhere``).
  The same beacon for the communication-regression watch: a node whose latest window was slower without the
  time going to collectives (a rank there computes more) holds ``jobs/<job>/slow_off_links/<node>``, and a node
  about to record a regression first reads ``jobs/<job>/slow_off_links/``: while another node is there, its own
  ranks may only be waiting for that node's (agent/watchdog/comm_watch.py). Written only when that changes.

* **Growing** (``agree_checkpoint_step``). When nodes wait to join a healthy round, every node's launcher
  pauses its restart; the first node to propose a step after which all workers checkpoint and hold wins
  ``jobs/<job>/grow/<round>`` (created only if absent), and every node reads the same step from it. The save
  is collective, so one step for all is the whole point. Under a lease: the key goes with the round.

* **Leaving** (``request_leave``, ``read_leave``). A node that is drained leaves the job without losing a step:
  it writes ``jobs/<job>/leave/<round>`` = the node and a step (created only if absent: one leaver per round);
  every node's launcher watches ``jobs/<job>/leave/`` and its own ``jobs/<job>/exclude/<node>`` (``LeaveWatch``), has its workers save after the step and hold, and once it is
  committed the leaver stops its workers and the others regroup without it. Under a lease, like ``grow``.

* **Rounds and commits** (``advance_round``, ``commit_in_round``). ``jobs/<job>/round`` holds the newest
  worker round any node started, as ``<generation>.<rendezvous round>`` (zero-padded: the text order is the
  order). A checkpoint is published (``jobs/<job>/checkpoint``) only in a transaction that finds the
  committing worker's round still there; a node left in an older round is refused, and its checkpoint is
  set aside, never taken for the job's state (DESIGN: fenced rounds).

Every call has the client's timeout; a failure is the caller's to handle (the watchdog then acts alone, as
on one node). Only this module knows these key names.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable, Mapping

from trainwarden.agent.etcd.client import describe_etcd_error, read_json_prefix, refresh_lease, with_failover
from trainwarden.agent.etcd.keys import DEFAULT_PREFIX, job_key
from trainwarden.agent.etcd.watch import KeyWatch

logger = logging.getLogger(__name__)

__all__ = ["GROW_KEY_TTL_S", "LEAVE_CAUSES", "advance_round", "commit_in_round", "read_leave", "request_leave", "round_id", "LeaveWatch", "PROGRESS_PERIOD_S", "PROGRESS_TTL_S", "BUSY_TTL_S", "HANG_KEY_TTL_S", "VERDICT_GRACE_S", "HangCoordinator", "ProgressPublisher", "agree_checkpoint_step",
           "read_progress"]

BUSY_TTL_S = 10
"""The lease of a node's busy beacons (kept alive every third of it while the node works): how long a node whose
agent died can still be taken for working."""
HANG_KEY_TTL_S = 15
"""How long a hang's election and verdicts stay: longer than the spread of the nodes' detections, shorter than
a restart, so the same step hanging again in the next round is a new incident."""
VERDICT_GRACE_S = 1.0
"""How long the owner of a hang waits for the other live nodes' verdicts before it has its own workers aborted
(``HangCoordinator.coordinate``'s ``on_wait``); it goes on waiting for them up to ``verdict_wait_s`` for the
incident. The nodes of a job judge the same last step against about the same deadline, four times a second."""


PROGRESS_PERIOD_S = 10.0
"""How often a node puts its progress summary (one put and one lease keep-alive each time). Its readers are people
(`trainwarden status --etcd`: each node's ranks and last step); no decision reads it (a hang's owner waits for the
live members, ``jobs/<job>/nodes/``). Every 3 s it was 2,700 requests a second at 4,000 nodes for a view a person
refreshes by hand; at 10 s it is 800."""
PROGRESS_TTL_S = 30
"""The summary's lease: three periods, so one slow put does not make a node look silent."""


GROW_KEY_TTL_S = 300
"""How long a round's agreed grow step stays: longer than any wait for the checkpoint (GROW_WAIT_S)."""


def agree_checkpoint_step(client, job: str, round_key: str, proposal: int, node: str, *,
                          prefix: str = DEFAULT_PREFIX) -> tuple[int, str]:
    """The step after which every worker of ``job`` checkpoints before the round ``round_key`` grows, and the
    node that proposed it: ``proposal`` if this node is first, else the step the first node proposed."""
    key = job_key(job, "grow", round_key, prefix=prefix)
    lease = with_failover(client, lambda: client.lease(GROW_KEY_TTL_S))
    mine = json.dumps({"step": int(proposal), "node": node})
    won, responses = with_failover(client, lambda: client.transaction(
        compare=[client.transactions.version(key) == 0],
        success=[client.transactions.put(key, mine, lease=lease)],
        failure=[client.transactions.get(key)]))
    if won:
        return int(proposal), node
    try:
        agreed = json.loads(responses[0][0][0])
        return int(agreed["step"]), str(agreed.get("node", "?"))
    except (IndexError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{key} holds no step ({exc}); delete it to let the nodes agree again") from None


LEAVE_CAUSES = ("drain", "excluded")
"""Why a node leaves: an operator's drain (SIGUSR1), or a policy excluded it (``--straggler-policy exclude``,
``--link-policy exclude``). A hot spare that takes the leaver's ranks counts its swap by it."""


def request_leave(client, job: str, round_key: str, node: str, proposal: int, *, cause: str = "drain",
                  ranks=(), reason: str = "", prefix: str = DEFAULT_PREFIX) -> dict:
    """Ask to leave ``job`` after step ``proposal`` of round ``round_key``; the request that stands (this one,
    or another node's made first: then this node asks again in the next round). ``cause`` (``LEAVE_CAUSES``),
    the leaver's ``ranks`` in the round and ``reason`` go in the record for the spare that takes its place."""
    if cause not in LEAVE_CAUSES:
        raise ValueError(f"leave cause {cause!r}: expected one of {', '.join(LEAVE_CAUSES)}")
    key = job_key(job, "leave", round_key, prefix=prefix)
    lease = with_failover(client, lambda: client.lease(GROW_KEY_TTL_S))
    mine = {"node": node, "step": int(proposal), "cause": cause, "ranks": sorted(int(r) for r in ranks),
            "reason": reason[:500]}
    won, responses = with_failover(client, lambda: client.transaction(
        compare=[client.transactions.version(key) == 0],
        success=[client.transactions.put(key, json.dumps(mine), lease=lease)],
        failure=[client.transactions.get(key)]))
    if won:
        return mine
    try:
        return json.loads(responses[0][0][0])
    except (IndexError, TypeError, ValueError):
        return {}


def read_leave(client, job: str, round_key: str, *, prefix: str = DEFAULT_PREFIX) -> dict | None:
    """The leave request of round ``round_key`` of ``job``, if any: ``{"node", "step", "cause", "ranks",
    "reason"}`` (a record without the last three, from an older release: a drain, its ranks unknown)."""
    value, _ = with_failover(client, lambda: client.get(job_key(job, "leave", round_key, prefix=prefix)))
    if value is None:
        return None
    try:
        request = json.loads(value)
        return {"node": str(request["node"]), "step": int(request["step"]),
                "cause": str(request.get("cause") or "drain"),
                "ranks": tuple(sorted(int(r) for r in request.get("ranks") or ())),
                "reason": str(request.get("reason") or "")}
    except (KeyError, TypeError, ValueError):
        return None


LEAVE_REREAD_S = 60.0
"""How often ``LeaveWatch`` reads the leave requests and the exclusion again although its watches live: the net
under a watch that died unseen (python3-etcd3 drops them with a broken stream and says nothing; the watches are also
checked at each ``refresh``, locally)."""


class LeaveWatch:
    """The job's leave requests (``jobs/<job>/leave/<round>``) and this node's exclusion (``jobs/<job>/exclude/
    <node>``) as two watches; ``refresh()`` reads both again only when a watch is gone, at the first call and every
    ``LEAVE_REREAD_S``. Where every launcher read both every second (two reads a node a second), a quiet job now
    costs etcd nothing."""

    def __init__(self, client, job: str, node: str, *, prefix: str = DEFAULT_PREFIX,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client, self._clock = client, clock
        self._leave_root = job_key(job, "leave", "", prefix=prefix)
        self._exclude_key = job_key(job, "exclude", node, prefix=prefix)
        self._lock = threading.Lock()
        self._requests: dict[str, dict] = {}
        self._excluded = False
        self._watches: list[KeyWatch] = []
        self._read_at: float | None = None

    def refresh(self) -> None:
        """Read again and watch anew if needed (etcd calls: raises when etcd does not answer)."""
        if self._watches and all(w.alive() for w in self._watches) and self._read_at is not None \
                and self._clock() - self._read_at < LEAVE_REREAD_S:
            return
        self.stop()
        client = self._client
        self._watches = [KeyWatch(client, self._leave_root, self._on_leave, prefix=True),
                         KeyWatch(client, self._exclude_key, self._on_exclude)]
        for watch in self._watches:
            watch.start()  # before the reads: nothing changes unseen between the two
        requests = {}
        for round_key, value in read_json_prefix(client, self._leave_root).items():
            request = _leave_request(value)
            if request is not None:
                requests[round_key] = request
        value, _ = with_failover(client, lambda: client.get(self._exclude_key))
        with self._lock:
            self._requests, self._excluded = requests, value is not None
        self._read_at = self._clock()

    def request(self, round_key: str) -> dict | None:
        """Round ``round_key``'s leave request as last seen: ``{"node", "step"}``."""
        with self._lock:
            return self._requests.get(round_key)

    def excluded(self) -> bool:
        with self._lock:
            return self._excluded

    def stop(self) -> None:
        for watch in self._watches:
            watch.stop()
        self._watches = []

    def _on_leave(self, events: list) -> None:
        with self._lock:
            for event in events:
                round_key = event.key.decode()[len(self._leave_root):]
                request = None
                if type(event).__name__ != "DeleteEvent":
                    try:
                        request = _leave_request(json.loads(event.value))
                    except (TypeError, ValueError):
                        request = None
                if request is None:
                    self._requests.pop(round_key, None)
                else:
                    self._requests[round_key] = request

    def _on_exclude(self, events: list) -> None:
        with self._lock:
            self._excluded = type(events[-1]).__name__ != "DeleteEvent"


def _leave_request(value) -> dict | None:
    try:
        return {"node": str(value["node"]), "step": int(value["step"])}
    except (KeyError, TypeError, ValueError):
        return None


def round_id(generation: int, rendezvous_round: int) -> str:
    """The text stored in ``jobs/<job>/round``: comparing two as text compares the rounds."""
    return f"{int(generation):010d}.{int(rendezvous_round):010d}"


def _describe_round(value: str) -> str:
    try:
        generation, rendezvous_round = (int(part) for part in value.split("."))
        return f"round {rendezvous_round} of generation {generation}"
    except ValueError:
        return repr(value)


def advance_round(client, job: str, mine: str, *, prefix: str = DEFAULT_PREFIX,
                  extra: Callable[[Any], list] | None = None) -> str | None:
    """Make ``mine`` the job's current round unless a newer one is recorded (then: why not). With ``extra``,
    its operations (given the client) go in the same transaction, so they happen only in the current round."""
    key = job_key(job, "round", prefix=prefix)
    for _ in range(5):
        value, meta = with_failover(client, lambda: client.get(key))
        current = value.decode() if value is not None else None
        if current is not None and current > mine:
            return (f"the job's current round is {_describe_round(current)} and this worker's is "
                    f"{_describe_round(mine)}: it was left behind")
        txn = client.transactions
        compare = [txn.version(key) == 0] if current is None else [txn.mod(key) == meta.mod_revision]
        success = ([] if current == mine else [txn.put(key, mine)]) + (extra(client) if extra else [])
        if not success:
            return None
        ok, _ = with_failover(client, lambda: client.transaction(compare=compare, success=success, failure=[]))
        if ok:
            return None
    return f"{key} kept changing under this node; not acting for {_describe_round(mine)}"


def commit_in_round(client, job: str, mine: str, pointer: Mapping[str, Any], *,
                    prefix: str = DEFAULT_PREFIX) -> str | None:
    """Publish ``pointer`` as the job's latest checkpoint if ``mine`` is (or becomes) its current round; else
    why not."""
    key, value = job_key(job, "checkpoint", prefix=prefix), json.dumps(dict(pointer), sort_keys=True)
    return advance_round(client, job, mine, prefix=prefix, extra=lambda c: [c.transactions.put(key, value)])


def read_progress(client, job: str, *, prefix: str = DEFAULT_PREFIX) -> dict[str, dict]:
    """Every node's latest progress summary of ``job``, by node name."""
    summaries = read_json_prefix(client, job_key(job, "progress", "", prefix=prefix))
    return {node: summary for node, summary in summaries.items() if summary is not None}


class ProgressPublisher:
    """Publishes ``jobs/<job>/progress/<node>`` every ``period_s`` from ``snapshot()`` (JobSnapshots)."""

    def __init__(self, client, node: str, snapshot: Callable[[], list], *, period_s: float = PROGRESS_PERIOD_S,
                 ttl: int = PROGRESS_TTL_S, prefix: str = DEFAULT_PREFIX, wall: Callable[[], float] = time.time) -> None:
        self._client, self._node, self._snapshot = client, node, snapshot
        self._period, self._ttl, self._prefix, self._wall = period_s, ttl, prefix, wall
        self._lease = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainwarden-progress", daemon=True)
        self._failing = False

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 3.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._lease is not None:
            try:
                self._lease.revoke()
            except Exception:  # it expires anyway
                pass

    def publish_once(self) -> None:
        client = self._client
        if self._lease is None or not refresh_lease(client, self._lease):
            self._lease = with_failover(client, lambda: client.lease(self._ttl))
        for snap in self._snapshot():
            summary = {"node": self._node, "at": self._wall(), "ranks": {
                str(r.rank): {"last_step": r.last_step, "connected": r.connected} for r in snap.ranks}}
            key = job_key(snap.job, "progress", self._node, prefix=self._prefix)
            value = json.dumps(summary, sort_keys=True)
            with_failover(client, lambda k=key, v=value: client.put(k, v, lease=self._lease))

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self.publish_once()
                if self._failing:
                    logger.info("progress summaries reach etcd again")
                self._failing = False
            except Exception as exc:
                self._lease = None if self._failing else self._lease
                if not self._failing:
                    logger.warning("cannot publish progress summaries to etcd (%s); retrying",
                                   describe_etcd_error(exc))
                self._failing = True


class HangCoordinator:
    """One incident per hang across the job's nodes (module docstring)."""

    def __init__(self, client, node: str, *, prefix: str = DEFAULT_PREFIX, verdict_wait_s: float = 3.0,
                 peers: Callable[[str], list[str]] | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], Any] = time.sleep) -> None:
        """``peers(job)``: the job's other live nodes, whose verdicts the owner waits for (default: the nodes
        with a progress summary)."""
        self._client, self.node, self._prefix = client, node, prefix
        self._wait, self._clock, self._sleep = verdict_wait_s, clock, sleep
        self._peers = peers or (lambda job: [n for n in read_progress(client, job, prefix=prefix) if n != node])
        self._beacons: set[tuple[str, str]] = set()  # (job, kind) of the beacons this node holds
        self.unanswered: list[str] = []
        """The live nodes whose verdict the owner's last ``coordinate`` did not get (cut off, or the agent down)."""
        self._beacon_lease = None
        self._beacon_refreshed = 0.0

    def _key(self, job: str, key: str, *parts: str) -> str:
        return job_key(job, "hangs", key, *parts, prefix=self._prefix)

    def set_busy(self, job: str, busy: bool) -> None:
        """Say whether this node's ranks of ``job`` work while the job is stalled (module docstring); a beacon
        (``_set_beacon``). Called on every watchdog check; raises what etcd raises."""
        self._set_beacon(job, "busy", busy)

    def busy_elsewhere(self, job: str) -> list[str]:
        """The job's other nodes whose ranks work while it is stalled (their busy beacons)."""
        return self._beacons_elsewhere(job, "busy")

    def set_slow_off_links(self, job: str, slow: bool) -> None:
        """Say whether this node's latest window of ``job`` was slower without the time going to collectives
        (module docstring); a beacon. Raises what etcd raises."""
        self._set_beacon(job, "slow_off_links", slow)

    def slow_off_links_elsewhere(self, job: str) -> list[str]:
        """The job's other nodes whose latest window was slower off the links (their beacons)."""
        return self._beacons_elsewhere(job, "slow_off_links")

    def _set_beacon(self, job: str, kind: str, on: bool) -> None:
        """Hold ``jobs/<job>/<kind>/<node>`` while ``on``: a put when it starts, a keep-alive of the beacons' one
        lease every third of ``BUSY_TTL_S`` while any is held, a delete when it ends; nothing when it does not
        change. Raises what etcd raises."""
        client, key, held = self._client, job_key(job, kind, self.node, prefix=self._prefix), (job, kind)
        if not on:
            if held in self._beacons:
                self._beacons.discard(held)
                with_failover(client, lambda: client.delete(key))
            return
        now = self._clock()
        if self._beacon_lease is not None and self._beacons and now - self._beacon_refreshed >= BUSY_TTL_S / 3:
            self._beacon_refreshed = now
            if not refresh_lease(client, self._beacon_lease):
                self._beacon_lease, self._beacons = None, set()  # expired (etcd was away): put them again
        if held in self._beacons:
            return
        if self._beacon_lease is None or not self._beacons:
            self._beacon_lease = with_failover(client, lambda: client.lease(BUSY_TTL_S))
            self._beacon_refreshed = now
        value = json.dumps({"node": self.node})
        with_failover(client, lambda: client.put(key, value, lease=self._beacon_lease))
        self._beacons.add(held)

    def _beacons_elsewhere(self, job: str, kind: str) -> list[str]:
        """The job's other nodes that hold a ``kind`` beacon now."""
        beacons = read_json_prefix(self._client, job_key(job, kind, "", prefix=self._prefix))
        return sorted(node for node in beacons if node != self.node)

    def coordinate(self, job: str, key: str, incident_id: str, local: Mapping[str, Any], *,
                   on_wait: Callable[[dict[str, dict]], Any] | None = None) -> tuple[bool, dict]:
        """Share this node's verdict, then try to own the hang. Returns ``(True, verdicts by node)`` to the owner,
        once the other live nodes' verdicts are in or ``verdict_wait_s`` has passed, and ``(False, owner)`` to
        the others (``owner``: the owner's node and incident id). When verdicts are still missing after
        ``VERDICT_GRACE_S``, ``on_wait`` is called with those in so far before the owner waits on: a node cut off
        from the others never sends one, and the owner's workers should not be the last to stop (the others
        stopped theirs at once). The grace keeps the verdicts of the nodes that saw the hang at about the same
        time: once the owner's workers stop, the other nodes' ranks fail instead of hanging, and a node that had
        not judged yet never names its culprit."""
        client = self._client
        lease = with_failover(client, lambda: client.lease(HANG_KEY_TTL_S))
        verdict = json.dumps({**local, "node": self.node}, sort_keys=True, default=str)
        with_failover(client, lambda: client.put(self._key(job, key, "verdicts", self.node), verdict, lease=lease))
        owner_key = self._key(job, key, "owner")
        me = json.dumps({"node": self.node, "incident": incident_id})
        won, responses = with_failover(client, lambda: client.transaction(
            compare=[client.transactions.version(owner_key) == 0],
            success=[client.transactions.put(owner_key, me, lease=lease)],
            failure=[client.transactions.get(owner_key)]))
        if not won:
            try:
                holder = json.loads(responses[0][0][0])
            except (IndexError, TypeError, ValueError):
                holder = {}
            return False, holder
        expected = set(self._peers(job)) | {self.node}
        self.unanswered = []
        start = self._clock()
        # the nodes that saw the hang with this one answer within its grace; one that has not by then may never
        # (cut off), and the owner's workers should not stay the last ones standing
        verdicts = self._verdicts_of(job, key, expected, until=start + min(self._wait, VERDICT_GRACE_S))
        if not expected <= set(verdicts):
            if on_wait is not None:
                on_wait(dict(verdicts))
            verdicts = self._verdicts_of(job, key, expected, until=start + self._wait)
        self.unanswered = sorted(expected - set(verdicts))
        return True, verdicts

    def verdicts(self, job: str, key: str) -> dict[str, dict]:
        """The verdicts under the hang ``key`` now, by node (one read; the owner's late look,
        agent/watchdog/late_verdicts.py)."""
        return self._verdicts(job, key)

    def _verdicts_of(self, job: str, key: str, expected: set[str], *, until: float) -> dict[str, dict]:
        """The verdicts in, read again every 0.2 s until every node of ``expected`` has given one or ``until``."""
        verdicts = self._verdicts(job, key)
        while not expected <= set(verdicts) and self._clock() < until:
            self._sleep(0.2)
            verdicts = self._verdicts(job, key)
        return verdicts

    def _verdicts(self, job: str, key: str) -> dict[str, dict]:
        verdicts = read_json_prefix(self._client, self._key(job, key, "verdicts", ""))
        return {node: v for node, v in verdicts.items() if v is not None}


def merge_verdicts(verdicts: Mapping[str, Mapping[str, Any]]) -> tuple[dict[int, str], str]:
    """The culprits named by any node, with the node that named them, and one line for the incident."""
    culprits: dict[int, str] = {}
    for node, v in sorted(verdicts.items()):
        for rank in (v.get("verdict") or {}).get("culprits") or []:
            culprits.setdefault(int(rank), node)
    if culprits:
        named = ", ".join(f"rank {r} on {n}" for r, n in sorted(culprits.items()))
        why = "; ".join(f"{n}: {(verdicts[n].get('verdict') or {}).get('summary', '')}"
                        for n in sorted(set(culprits.values())))
        return culprits, f"culprit {named} ({why})"
    return culprits, "no node named a culprit: " + "; ".join(
        f"{n}: {(v.get('verdict') or {}).get('summary', '?')}" for n, v in sorted(verdicts.items()))

"""One link check per job at a time, started by whichever node saw the communication regression first.

Every node of a job whose links slowed detects the regression on its own ranks, within seconds of the others.
If each ran a link check, their probes would overlap and measure each other. So a node that wants one takes
``jobs/<job>/linkcheck/lock`` (a transaction that creates it under a short lease: one winner), runs
``check_links`` over the job's node records, and writes the report to ``jobs/<job>/linkcheck/last``; the
others wait for that record and use it. A report younger than ``reuse_s`` is reused, not redone.

All of it runs on a thread of its own: the watchdog that asks never waits for it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable

from trainwarden.agent.etcd.client import describe_etcd_error, with_failover
from trainwarden.agent.etcd.keys import DEFAULT_PREFIX, job_key
from trainwarden.agent.etcd.membership import live_nodes

__all__ = ["JobLinkCheck"]

log = logging.getLogger(__name__)

LOCK_TTL_S = 60


class JobLinkCheck:
    """``start(on_done)``: a link check of ``job`` (or the one another node runs), its report to ``on_done``
    as a JSON-able dict with ``by`` (the node that ran it) and ``at`` (unix time), or ``error``."""

    def __init__(self, client, job: str, node: str, *, prefix: str = DEFAULT_PREFIX, seconds: float = 0.5,
                 wait_s: float = 120.0, reuse_s: float = 60.0, check: Callable[..., Any] | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        self._client, self.job, self.node = client, job, node
        self._lock_key = job_key(job, "linkcheck", "lock", prefix=prefix)
        self._last_key = job_key(job, "linkcheck", "last", prefix=prefix)
        self._prefix, self._seconds, self._wait_s, self._reuse_s = prefix, seconds, wait_s, reuse_s
        self._wall = wall
        if check is None:
            from trainwarden.agent.linkcheck import check_links as check
        self._check = check
        self._busy = threading.Lock()

    def start(self, on_done: Callable[[dict], None]) -> bool:
        """Begin (False: one of this node's is still running, and its result goes to its own caller)."""
        if not self._busy.acquire(blocking=False):
            return False
        threading.Thread(target=self._run, args=(on_done,), name="trainwarden-linkcheck", daemon=True).start()
        return True

    def _run(self, on_done: Callable[[dict], None]) -> None:
        try:
            result = self._localize()
        except Exception as exc:  # etcd away, a probe server gone: the incident says so, nothing else breaks
            result = {"error": f"link check failed: {describe_etcd_error(exc)}", "by": self.node, "at": self._wall()}
        finally:
            self._busy.release()
        try:
            on_done(result)
        except Exception:
            log.exception("handling the link check's result failed")

    def _last(self) -> dict | None:
        value, _ = with_failover(self._client, lambda: self._client.get(self._last_key))
        try:
            return json.loads(value) if value else None
        except ValueError:
            return None

    def _localize(self) -> dict:
        asked = self._wall()
        last = self._last()
        if last is not None and asked - float(last.get("at", 0)) < self._reuse_s:
            return last
        client = self._client
        lease = with_failover(client, lambda: client.lease(LOCK_TTL_S))
        won, _ = with_failover(client, lambda: client.transaction(
            compare=[client.transactions.create(self._lock_key) == 0],
            success=[client.transactions.put(self._lock_key, self.node, lease=lease)], failure=[]))
        if not won:
            lease.revoke()
            return self._wait_for_other(asked)
        try:
            log.warning("job %s: checking the links between its nodes (this node runs the check)", self.job)
            report = self._check(live_nodes(client, self.job, prefix=self._prefix), seconds=self._seconds)
            result = {**report.to_json(), "by": self.node, "at": self._wall()}
            with_failover(client, lambda: client.put(self._last_key, json.dumps(result)))
            return result
        finally:
            lease.revoke()

    def _wait_for_other(self, asked: float) -> dict:
        deadline = time.monotonic() + self._wait_s
        while time.monotonic() < deadline:
            last = self._last()
            if last is not None and float(last.get("at", 0)) > asked - self._reuse_s:
                return last
            time.sleep(1.0)
        return {"error": f"no link check report from the node running it within {self._wait_s:.0f} s",
                "by": self.node, "at": self._wall()}

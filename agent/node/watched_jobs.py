"""This node's copy of the jobs in etcd, kept up to date by watches (issue 28: watching, not polling).

The job runner (agent/node/job_runner.py) decides each round from this copy. It watches ``jobs/.index/`` (every
submit, stop, resume and refusal rewrites the job's entry there; the copy then reads that job's spec, state and
control), ``jobs/<job>/state`` of each live job (the phase, taken from the event itself) and ``nodes/<node>/cordon``.
An event wakes the runner's loop at once (``wake``). A dead watch, a failed call (``resync_due``) and every
``SAFETY_REREAD_S`` make it read the index, the jobs that may have changed and the cordon again and watch anew: the
watches' liveness is checked without asking etcd anything (agent/etcd/watch.py: python3-etcd3 never tells a callback
that its stream broke). The first read after the daemon starts lists every job (``JobControl.jobs``) and indexes the
ones submitted before the index existed.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Callable

from trainwarden.agent.common.job_lifecycle import JobPhase
from trainwarden.agent.etcd.client import describe_etcd_error
from trainwarden.agent.etcd.jobs import JobControl, JobView
from trainwarden.agent.etcd.watch import KeyWatch

logger = logging.getLogger(__name__)

__all__ = ["LIVE_PHASES", "SAFETY_REREAD_S", "WatchedJobs"]

SAFETY_REREAD_S = 60.0
"""How often the runner reads the index, the live jobs and the cordon again although its watches live: the net
under what no check sees (a watch stream that broke without a word, an event lost). A change then reaches the
daemon within this long at worst; normally within a watch event's delivery (milliseconds). 4,000 daemons at 60 s make
67 reads of the small index a second."""
LIVE_PHASES = frozenset({JobPhase.PENDING.value, JobPhase.STARTING.value, JobPhase.RUNNING.value,
                         JobPhase.RESTARTING.value})
"""Phases in which a job wants its launchers."""


class WatchedJobs:
    """The jobs (``views``) and this node's cordon (``cordon``) as etcd last said, and the watches that keep them."""

    def __init__(self, client, control: JobControl, *, node: str, clock: Callable[[], float]) -> None:
        self._client, self._control, self._node, self._clock = client, control, node, clock
        self.views: dict[str, JobView] = {}  # the jobs as last read from etcd (spec, state, control; no members)
        self.cordon: dict | None = None  # this node's cordon, None when in service
        self.wake = threading.Event()  # set by every watch event: the runner's loop waits on it
        self.resync_due = True  # read everything again at the next refresh (a call failed, a watch died)
        self.watches: dict[str, KeyWatch] = {}  # "index", "cordon", "state:<job>"
        self._indexed: dict[str, int] = {}  # job -> mod revision of its index entry when last read
        self._changed: set[str] = set()  # jobs whose index entry changed since they were read (watch thread)
        self._events = threading.Lock()
        self._read_at: float | None = None  # monotonic time of the last full read
        self._listed = False  # whether every job was listed once (the index's back-fill)

    def stop(self) -> None:
        for watch in list(self.watches.values()):
            watch.stop()
        self.watches.clear()

    def refresh(self) -> None:
        """Bring the copy of the jobs and the cordon up to date: read what the watches said changed; read
        everything again (and watch anew) when a watch is gone, a call failed, or ``SAFETY_REREAD_S`` passed."""
        now = self._clock()
        if (self.resync_due or self._read_at is None or now - self._read_at >= SAFETY_REREAD_S
                or not all(w.alive() for w in self.watches.values())):
            self._resync()
            return
        with self._events:
            changed, self._changed = self._changed, set()
        for name in sorted(changed):
            self._read_job(name)
        self._watch_states()

    def _resync(self) -> None:
        for watch in self.watches.values():
            watch.stop()
        self.watches.clear()
        with self._events:
            self._changed.clear()
        control = self._control
        index = KeyWatch(self._client, control.index_key(), self._on_index, prefix=True, on_error=self._on_error)
        index.start()  # before the reads: a change after them arrives as an event, none falls in between
        self.watches["index"] = index
        cordon = KeyWatch(self._client, control.node_key(self._node, "cordon"), self._on_cordon,
                          on_error=self._on_error)
        cordon.start()
        self.watches["cordon"] = cordon
        indexed = control.index()
        if not self._listed:  # once per daemon: jobs submitted before the index existed get an entry
            missing = [view for view in control.jobs() if view.managed and view.name not in indexed]
            for view in missing:
                control.ensure_indexed(view)
            if missing:
                indexed = control.index()
            self._listed = True
        for name in list(self.views):
            if name not in indexed:
                del self.views[name]
        for name, revision in sorted(indexed.items()):
            view = self.views.get(name)
            if view is None or self._indexed.get(name) != revision or view.phase in LIVE_PHASES:
                self._read_job(name)
            self._indexed[name] = revision
        self.cordon = control.cordoned(self._node)
        self._watch_states()
        self._read_at, self.resync_due = self._clock(), False

    def _read_job(self, name: str) -> None:
        view = self._control.job(name, members=False)
        if view is None:
            self.views.pop(name, None)
        else:
            self.views[name] = view

    def _watch_states(self) -> None:
        """A watch on the state of each live submitted job (its phase, which launchers move on), none on others."""
        wanted = {f"state:{name}" for name, view in self.views.items() if view.managed and view.phase in LIVE_PHASES}
        for key in [k for k in self.watches if k.startswith("state:") and k not in wanted]:
            self.watches.pop(key).stop()
        for key in sorted(wanted - set(self.watches)):
            name = key.split(":", 1)[1]
            watch = KeyWatch(self._client, self._control.key(name, "state"),
                             lambda events, n=name: self._on_state(n, events), on_error=self._on_error)
            watch.start()
            self.watches[key] = watch
            self._read_job(name)  # what changed before the watch began

    # The watch callbacks run on the etcd client's thread: they note what changed and wake the loop, nothing more.

    def _on_index(self, events: list) -> None:
        root = self._control.index_key()
        with self._events:
            self._changed.update(e.key.decode()[len(root):] for e in events)
        self.wake.set()

    def _on_state(self, name: str, events: list) -> None:
        with self._events:
            view = self.views.get(name)
            for event in events:
                try:
                    state = json.loads(event.value) if getattr(event, "value", None) else None
                except ValueError:
                    state = None
                if view is None or not isinstance(state, dict):
                    self._changed.add(name)  # deleted or unreadable: read the job again
                else:
                    view.state = state
        self.wake.set()

    def _on_cordon(self, events: list) -> None:
        with self._events:
            for event in events:
                try:
                    self.cordon = json.loads(event.value) if getattr(event, "value", None) else None
                except ValueError:
                    self.cordon = {"unreadable": True}
        self.wake.set()

    def _on_error(self, exc: BaseException) -> None:
        logger.info("an etcd watch of the jobs broke (%s); reading them again", describe_etcd_error(exc))
        self.resync_due = True
        self.wake.set()

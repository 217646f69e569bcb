"""Where a job's goodput ledger (agent/launch/goodput.py) outlives its launcher: in etcd, so that the next launcher
of the job on any node (a restart of `trainwarden run`, a resumed daemon job, a node that joins) continues it, and
in the job's state directory (``history/goodput.json``), for a one-node run whose embedded etcd ends with it.

Each node's launcher publishes its ledger's ``state()`` to ``<prefix>/jobs/<job>/goodput/<node>`` every
``period_s`` and when it ends, through the run's EtcdWriter (queued: no thread of the run waits for etcd). The
ledgers of one job's nodes describe the same job, so a reader takes one: the oldest (the earliest ``launched``,
which every ledger that resumed from it shares), and of those the one with the latest word (``as_of``).
``load_goodput`` is what a new launcher resumes from; ``job_goodput`` what `trainwarden jobs` shows.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Callable, Iterable

from trainwarden.agent.etcd.client import describe_etcd_error
from trainwarden.agent.etcd.keys import DEFAULT_PREFIX, job_key

logger = logging.getLogger(__name__)

__all__ = ["GOODPUT_PERIOD_S", "GoodputPublisher", "choose", "goodput_key", "job_goodput", "load_goodput"]


def goodput_key(job: str, node: str = "", *, prefix: str = DEFAULT_PREFIX) -> str:
    """``<prefix>/jobs/<job>/goodput/<node>``; without a node, the prefix of the job's ledgers (with the slash)."""
    return job_key(job, "goodput", node, prefix=prefix)


def choose(states: Iterable[dict]) -> dict | None:
    """The job's ledger among its nodes' (module docstring); states without the two times are skipped."""
    usable = []
    for state in states:
        try:
            usable.append((float(state["launched"]), -float(state["as_of"]), state))
        except (KeyError, TypeError, ValueError):
            continue
    return min(usable, key=lambda t: t[:2])[2] if usable else None


def job_goodput(client, job: str, *, prefix: str = DEFAULT_PREFIX) -> dict | None:
    """The job's ledger as etcd holds it (None: none published). Raises what the client raises."""
    states = []
    for value, meta in client.get_prefix(goodput_key(job, prefix=prefix)):
        try:
            state = json.loads(value)
        except (TypeError, ValueError):
            logger.warning("ignoring a malformed goodput record %s", getattr(meta, "key", b"").decode(errors="replace"))
            continue
        if isinstance(state, dict):
            states.append(state)
    return choose(states)


def load_goodput(client, job: str, state_file: Path, *, prefix: str = DEFAULT_PREFIX) -> dict | None:
    """What a new launcher of ``job`` resumes from: etcd's ledger and the state directory's, the job's (``choose``).
    An unreachable etcd or an unreadable file is logged and leaves the other source."""
    states = []
    if client is not None:
        try:
            found = job_goodput(client, job, prefix=prefix)
            if found is not None:
                states.append(found)
        except Exception as exc:
            logger.warning("cannot read job %s's goodput from etcd (%s); counting from the state directory's",
                           job, describe_etcd_error(exc))
    try:
        local = json.loads(state_file.read_text())
        if isinstance(local, dict):
            states.append(local)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        logger.warning("ignoring the unreadable goodput record %s: %s", state_file, exc)
    return choose(states)


GOODPUT_PERIOD_S = 15.0
"""How often a node puts its goodput ledger (``jobs/<job>/goodput/<node>``, through the run's ``EtcdWriter``):
what a node that dies loses of its ledger, at most (the next launcher continues from the newest copy). One put of
about a kilobyte every 15 s is 267 puts a second at 4,000 nodes, a small part of a 3-member etcd's load (docs/
OPERATIONS.md, "Fleet size and etcd load")."""


class GoodputPublisher:
    """Puts ``state()`` to the node's key every ``period_s`` and once more at ``stop()``."""

    def __init__(self, writer, job: str, node: str, state: Callable[[], dict], *, period_s: float = GOODPUT_PERIOD_S,
                 prefix: str = DEFAULT_PREFIX) -> None:
        self._writer, self._state, self._period = writer, state, period_s
        self._key = goodput_key(job, node, prefix=prefix)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainwarden-goodput", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def publish(self) -> None:
        self._writer.put(self._key, json.dumps(self._state(), sort_keys=True))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.publish()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self.publish()

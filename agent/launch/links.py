"""Link checks in ``trainwarden run`` (agent/linkcheck): the node's probe server, the watchdog's way to ask for a
check when collectives slow down, and ``--link-policy exclude`` acting on the report.

``LinkChecks`` is a part the run (agent/launch/run.py) owns, not a mixin: it is given the job, the node and its
policy, and two callbacks into the leave protocol (regroup.py): whether this node already leaves, and what makes it
leave. The etcd client comes with ``ask_on_regression``; tests give a fake ``control`` for the cordon.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from typing import Any, Callable, TextIO

from trainwarden.agent.etcd.client import describe_etcd_error
from trainwarden.agent.etcd.jobs import JobControl
from trainwarden.agent.linkcheck import RECORD_FIELD, ProbeError, ProbeServer
from trainwarden.agent.linkcheck.coordinate import JobLinkCheck

__all__ = ["LinkChecks"]

logger = logging.getLogger("trainwarden.agent.launch.run")  # the run's log


class LinkChecks:
    """The link-check side of one multi-node ``trainwarden run`` (module docstring).

    ``policy``: ``--link-policy`` (``exclude`` makes a node named slow leave); ``leaving``: this node already leaves
    the job; ``leave(reason)``: leave it at a step boundary after a checkpoint, excluded for ``reason``."""

    def __init__(self, *, job: str, node: str, policy: str, out: TextIO, leaving: Callable[[], bool],
                 leave: Callable[[str], None], control: Callable[[Any], Any] = JobControl) -> None:
        self.job, self.node, self.policy, self._out = job, node, policy, out
        self._leaving, self._leave, self._control = leaving, leave, control
        self._client = None

    def serve_probe(self, record: dict, cleanup: ExitStack, address: str | None) -> None:
        """Serve link probes on this node's job ``address`` and advertise them in its membership ``record`` (None:
        a one-node job, or no address: no probe)."""
        if not address:
            return
        try:
            server = ProbeServer(self.node, address).start()
        except ProbeError as exc:
            logger.warning("no link probe on this node (link checks will skip it): %s", exc)
            return
        cleanup.callback(server.stop)
        record[RECORD_FIELD] = server.record()

    def ask_on_regression(self, watchdog, client) -> None:
        """A communication regression the ``watchdog`` finds asks for one link check of the job; its report also
        goes to the policy (``on_report``)."""
        self._client = client
        links = JobLinkCheck(client, self.job, self.node)

        def localize(job: str, done) -> None:
            links.start(lambda report: (done(report), self.on_report(report)))

        watchdog.link_check = localize

    def on_report(self, report: dict) -> None:
        """``--link-policy exclude``: a link check named this node's link slow, so this node leaves the job at
        a step boundary after a checkpoint (the leave protocol, agent/launch/regroup.py) and is cordoned."""
        mine = [f for f in report.get("findings") or () if f.get("kind") == "node" and f.get("nodes") == [self.node]]
        if not mine or self.policy != "exclude" or self._leaving():
            return
        reason = f"link check: {report.get('summary', 'this node is slow')}"[:500]
        print(f"trainwarden: node {self.node} leaves job {self.job} (--link-policy exclude): {reason}",
              file=self._out, flush=True)
        try:
            self._control(self._client).cordon(self.node, reason,
                                               by=f"trainwarden run on {self.node} (--link-policy exclude)")
        except Exception as exc:
            logger.warning("cannot cordon node %s: %s", self.node, describe_etcd_error(exc))
        self._leave(reason)

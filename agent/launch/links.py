"""Link checks in ``trainwarden run`` (agent/linkcheck): the node's probe server, the watchdog's way to ask for a
check when collectives slow down, and ``--link-policy exclude`` acting on the report.

``LinkChecks`` is a mixin of ``_JobRun`` (agent/launch/run.py), as ``Regrouping`` is: it uses the run's state
(options, node, etcd client, the leave request) and is not meant to stand alone.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack

from trainwarden.agent.etcd.client import describe_etcd_error
from trainwarden.agent.etcd.jobs import JobControl
from trainwarden.agent.linkcheck import RECORD_FIELD, ProbeError, ProbeServer
from trainwarden.agent.linkcheck.coordinate import JobLinkCheck

__all__ = ["LinkChecks"]

logger = logging.getLogger("trainwarden.agent.launch.run")  # the run's log


class LinkChecks:
    """The link-check side of one multi-node ``trainwarden run`` (module docstring)."""

    def _start_link_probe(self, record: dict, cleanup: ExitStack) -> None:
        """Serve link probes on this node's job address and advertise them in its membership ``record``."""
        if not self._multi_node or not self.local_addr:
            return
        try:
            server = ProbeServer(self.node, self.local_addr).start()
        except ProbeError as exc:
            logger.warning("no link probe on this node (link checks will skip it): %s", exc)
            return
        cleanup.callback(server.stop)
        record[RECORD_FIELD] = server.record()

    def _ask_for_link_checks(self, agent) -> None:
        """A communication regression asks for one link check of the job; its report also goes to the policy."""
        links = JobLinkCheck(self.client, self.opts.job, self.node)

        def localize(job: str, done) -> None:
            links.start(lambda report: (done(report), self._on_link_report(report)))

        agent.watchdog.link_check = localize

    def _on_link_report(self, report: dict) -> None:
        """``--link-policy exclude``: a link check named this node's link slow, so this node leaves the job at
        a step boundary after a checkpoint (the leave protocol, agent/launch/regroup.py) and is cordoned."""
        mine = [f for f in report.get("findings") or () if f.get("kind") == "node" and f.get("nodes") == [self.node]]
        if not mine or self.opts.link_policy != "exclude" or self._leave_asked.is_set():
            return
        reason = f"link check: {report.get('summary', 'this node is slow')}"[:500]
        print(f"trainwarden: node {self.node} leaves job {self.opts.job} (--link-policy exclude): {reason}",
              file=self.out, flush=True)
        try:
            JobControl(self.client).cordon(self.node, reason, by=f"trainwarden run on {self.node} (--link-policy exclude)")
        except Exception as exc:
            logger.warning("cannot cordon node %s: %s", self.node, describe_etcd_error(exc))
        self._leave_cause, self._leave_reason = "excluded", reason
        self._leave_asked.set()

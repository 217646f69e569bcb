"""What a ``trainwarden run`` counts for its job (issue 27): the history `trainwarden report` reads
(agent/common/job_history.py), the goodput ledger carried on from the job's last launcher and published for the next
one (goodput.py, goodput_store.py), and the MFU gauge (mfu.py).

``Accounting`` is a mixin of ``_JobRun`` (agent/launch/run.py), as ``Regrouping`` and ``LinkChecks`` are: it uses the
run's state (options, node, state directory, etcd client and writer, the ledger, output) and is not meant to stand
alone.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import ExitStack

from trainwarden.agent.common.job_history import JobHistory
from trainwarden.agent.incidents.record import Incident
from trainwarden.agent.launch.goodput_store import GoodputPublisher, load_goodput
from trainwarden.agent.launch.mfu import MfuGauge, detect_peak_tflops

__all__ = ["Accounting"]

logger = logging.getLogger("trainwarden.agent.launch.run")  # the run's log


class Accounting:
    """The accounting side of one ``trainwarden run`` (module docstring)."""

    def _new_history(self) -> JobHistory:
        return JobHistory(self.state_dir / "history", goodput=self.goodput.state)

    def start_history(self, cleanup: ExitStack) -> None:
        """What `trainwarden report` reads afterwards (agent/common/job_history.py)."""
        if self.history.start():
            cleanup.callback(self.history.close)
        self.history.event("launched", node=self.node, pid=os.getpid(), nnodes=self.opts.nnodes,
                           nproc_per_node=self.opts.nproc_per_node)

    def continue_goodput(self, cleanup: ExitStack) -> None:
        """Carry on the job's ledger from its last launcher, here or on another node (agent/launch/goodput_store.py),
        and publish this one's from now on."""
        state = load_goodput(self.client, self.opts.job, self.history.directory / "goodput.json")
        if state is not None:
            try:
                self.goodput.resume(state, now=time.time())
            except (KeyError, TypeError, ValueError) as exc:
                logger.warning("job %s: not continuing its goodput ledger from %s (%s); counting from this launch",
                               self.opts.job, state.get("node") or "the state directory", exc)
        publisher = GoodputPublisher(self.writer, self.opts.job, self.node, self.goodput.state)
        publisher.start()
        cleanup.callback(publisher.stop)

    def _register_mfu(self, agent) -> None:
        """``trainwarden_mfu_ratio`` on the run's agent, when the user said what a step costs."""
        self.mfu = self._mfu_gauge(agent)
        if self.mfu is not None:
            agent.registry.register(self.mfu)

    def _mfu_gauge(self, agent) -> MfuGauge | None:
        """``trainwarden_mfu_ratio`` when the user said what a step costs and the peak is known."""
        opts = self.opts
        if not (opts.flops_per_step or opts.model_params):
            return None
        peak, where = opts.peak_tflops, "--peak-tflops"
        if not peak:
            found = detect_peak_tflops()
            if found is None:
                print("trainwarden: no MFU: the accelerator's peak is unknown (no GPU with a known name); pass "
                      "--peak-tflops", file=self.out, flush=True)
                return None
            peak, where = found
        self._mfu_basis = (f"{'--flops-per-step' if opts.flops_per_step else '6 x --model-params x tokens'}, "
                           f"{peak:g} TFLOPS per accelerator ({where})")
        return MfuGauge(opts.job, self.node, agent.job_telemetry.snapshot, peak_tflops=peak,
                        flops_per_step=opts.flops_per_step, model_params=opts.model_params)

    def _mfu_line(self) -> str | None:
        if self.mfu is None:
            return None
        try:
            ratio = self.mfu.ratio()
        except Exception:
            ratio = None
        return f"{100 * ratio:.1f}% ({self._mfu_basis})" if ratio is not None else None

    def _on_incident(self, incident: Incident) -> None:
        if incident.job == self.opts.job:  # a hang, a straggler or a communication regression: badput's causes
            self.goodput.incident(incident.kind.value, incident.state.value, incident.id)

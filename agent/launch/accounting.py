"""What a ``trainwarden run`` counts for its job (issue 27): the history `trainwarden report` reads
(agent/common/job_history.py), the goodput ledger carried on from the job's last launcher and published for the next
one (goodput.py, goodput_store.py), and the MFU gauge (mfu.py).

``Accounting`` is a part the run (agent/launch/run.py) owns, not a mixin: it holds the ledger and the history the
supervisor feeds (rounds, steps, checkpoints) and reads nothing of the run's; what it needs of etcd and the agent is
passed to the step that needs it.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, TextIO

from trainwarden.agent.common.job_history import JobHistory
from trainwarden.agent.incidents.record import Incident
from trainwarden.agent.launch.goodput import GoodputLedger
from trainwarden.agent.launch.goodput_store import GoodputPublisher, load_goodput
from trainwarden.agent.launch.mfu import MfuGauge, detect_peak_tflops

__all__ = ["Accounting"]

logger = logging.getLogger("trainwarden.agent.launch.run")  # the run's log


class Accounting:
    """The accounting side of one ``trainwarden run`` (module docstring): ``goodput`` and ``history`` are fed by the
    supervisor; ``mfu`` is the gauge once registered (None: the step's cost or the peak is unknown)."""

    def __init__(self, *, job: str, node: str, state_dir: Path, out: TextIO,
                 detect_peak: Callable[[], tuple[float, str] | None] = detect_peak_tflops) -> None:
        self.job, self.node, self._out, self._detect_peak = job, node, out, detect_peak
        self.goodput = GoodputLedger(job, launched_at=time.time(), node=node)
        self.history = JobHistory(state_dir / "history", goodput=self.goodput.state)
        self.mfu: MfuGauge | None = None
        self._mfu_basis = ""

    def start_history(self, cleanup: ExitStack, *, nnodes: str, nproc_per_node: int) -> None:
        """What `trainwarden report` reads afterwards (agent/common/job_history.py)."""
        if self.history.start():
            cleanup.callback(self.history.close)
        self.history.event("launched", node=self.node, pid=os.getpid(), nnodes=nnodes, nproc_per_node=nproc_per_node)

    def continue_goodput(self, cleanup: ExitStack, client, writer) -> None:
        """Carry on the job's ledger from its last launcher, here or on another node (agent/launch/goodput_store.py),
        and publish this one's from now on (through the run's etcd ``writer``)."""
        state = load_goodput(client, self.job, self.history.directory / "goodput.json")
        if state is not None:
            try:
                self.goodput.resume(state, now=time.time())
            except (KeyError, TypeError, ValueError) as exc:
                logger.warning("job %s: not continuing its goodput ledger from %s (%s); counting from this launch",
                               self.job, state.get("node") or "the state directory", exc)
        publisher = GoodputPublisher(writer, self.job, self.node, self.goodput.state)
        publisher.start()
        cleanup.callback(publisher.stop)

    def register_mfu(self, agent, *, flops_per_step: float, model_params: float, peak_tflops: float) -> None:
        """``trainwarden_mfu_ratio`` on the run's agent, when the user said what a step costs."""
        self.mfu = self._mfu_gauge(agent, flops_per_step, model_params, peak_tflops)
        if self.mfu is not None:
            agent.registry.register(self.mfu)

    def _mfu_gauge(self, agent, flops_per_step: float, model_params: float, peak: float) -> MfuGauge | None:
        """``trainwarden_mfu_ratio`` when the user said what a step costs and the peak is known."""
        if not (flops_per_step or model_params):
            return None
        where = "--peak-tflops"
        if not peak:
            found = self._detect_peak()
            if found is None:
                print("trainwarden: no MFU: the accelerator's peak is unknown (no GPU with a known name); pass "
                      "--peak-tflops", file=self._out, flush=True)
                return None
            peak, where = found
        self._mfu_basis = (f"{'--flops-per-step' if flops_per_step else '6 x --model-params x tokens'}, "
                           f"{peak:g} TFLOPS per accelerator ({where})")
        return MfuGauge(self.job, self.node, agent.job_telemetry.snapshot, peak_tflops=peak,
                        flops_per_step=flops_per_step, model_params=model_params)

    def mfu_line(self) -> str | None:
        """The summary's MFU line (None: no gauge, or no reading)."""
        if self.mfu is None:
            return None
        try:
            ratio = self.mfu.ratio()
        except Exception:
            ratio = None
        return f"{100 * ratio:.1f}% ({self._mfu_basis})" if ratio is not None else None

    def on_incident(self, incident: Incident) -> None:
        """The agent's incidents: a hang, a straggler or a communication regression of this job is badput's cause."""
        if incident.job == self.job:
            self.goodput.incident(incident.kind.value, incident.state.value, incident.id)

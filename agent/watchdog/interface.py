"""The watchdog's interface to the node: what the loop acts through (``WatchdogActions``, the agent provides
them) and what it is configured with (``WatchdogConfig``: its pace and its detectors' policies)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from trainwarden.agent.incidents import Incident
from trainwarden.agent.shared.contract import MAX_STEP_SEND_S
from trainwarden.agent.watchdog.comm_regression import CommRegressionConfig
from trainwarden.agent.watchdog.hang import HangConfig
from trainwarden.agent.watchdog.straggler import StragglerConfig

__all__ = ["WatchdogActions", "WatchdogConfig"]


class WatchdogActions(Protocol):
    """What the watchdog asks of the agent."""

    def request_diagnostics(self, job: str, ranks: Sequence[int], directory: Path) -> Sequence[int]:
        """Ask `ranks` to write stacks and a Flight Recorder dump into `directory` (it exists); return the
        ranks the request reached."""

    def abort(self, job: str, ranks: Sequence[int], reason: str) -> bool:
        """Make the local workers of `ranks` exit (torchrun restarts the group); True when done."""

    def request_exclusion(self, job: str, node: str, request: Mapping[str, Any]) -> None:
        """Record that `node` should be left out of the job's next rendezvous (straggler policy exclude)."""

    def withdraw_exclusion(self, job: str, node: str) -> None:
        """Withdraw that request (the straggler recovered)."""

    def record(self, incident: Incident) -> Incident:
        """Store this version of the incident (same id = same incident, newer state)."""

    def set_read_pace(self, job: str, ranks: Sequence[int], period_s: float, send_s: float = 0.0) -> Sequence[int]:
        """Ask `ranks` to read their Flight Recorder at most every `period_s` seconds (0: at their own
        pace) and to hold back steps that keep ending for up to `send_s` (0: send every flush); return the ranks
        the request reached."""


@dataclass(frozen=True, kw_only=True)
class WatchdogConfig:
    """How the watchdog runs."""

    interval_s: float = 0.25
    """Seconds between checks: what a hang's detection may lag its deadline (0.5 s until the floor went from 5 s to 2 s)."""
    diagnostics_wait_s: float = 3.0
    """How long to wait for the ranks' diagnostics after a hang."""
    abort_on_hang: bool = True
    """Abort the local workers after a hang (False: record only)."""
    hang: HangConfig = field(default_factory=HangConfig)
    """The hang deadline policy."""
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    """The straggler scoring policy."""
    comm_regression: CommRegressionConfig = field(default_factory=CommRegressionConfig)
    """When a job-wide slowdown is a communication regression (agent/watchdog/comm_regression.py)."""
    straggler_trace_dir: Path | None = None
    """Record what the straggler detector is fed here, one file per job (agent/watchdog/straggler_trace.py)."""
    quiet_read_period_s: float = 6.0
    """The Flight Recorder read period the workers are asked for while neither the straggler detector nor the
    communication-regression one is near a decision on their job (0: never ask; they read at their own pace,
    `ClientConfig.fr_interval_s`). A read dumps the whole ring with the worker's GIL held: 4-11 ms a read on
    2 busy cores (BENCHMARKS.md, issue 48), most of watching's cost; between decisions nothing needs arrivals
    sooner. Short enough that a straggler's first slices (`StragglerDetector.near_decision`) arrive while its
    flag is still slices away, and a degraded link's first slow window (`CommRegressionDetector.near_decision`)
    brings the reads back to their own pace for the windows that judge it. 3 s until session 35."""
    quiet_after_s: float = 10.0
    """How long nothing may have been near a decision before the workers are asked to read slowly."""
    quiet_step_send_s: float = 2.0
    """At the same quiet times, how long the workers may hold back steps that keep ending (0: never ask; they send
    every flush interval). 2 s halves watching's messages (BENCHMARKS.md issue 48 item 6): each send costs the
    worker's Python time and gRPC's threads. A batch promises the next, and one comes at a look soon after the steps
    stop, so hangs are heard of as before (runtime/send_pace.py). Off in session 38 after a soak broke two invariants
    with it on; the cause was the hang clock's 1 s cap on a late report's age, in both modes (loop.py
    ``REPORT_AGE_CAP_S``), and two soaks with it on after the fix broke none (session 39). Asked only of a job whose
    every connected rank reports steps: a job's progress is its newest step."""

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {self.interval_s}")
        if not self.diagnostics_wait_s >= 0:
            raise ValueError(f"diagnostics_wait_s must be 0 or more, got {self.diagnostics_wait_s}")
        if not 0 <= self.quiet_step_send_s <= MAX_STEP_SEND_S:
            raise ValueError(f"quiet_step_send_s must be between 0 and {MAX_STEP_SEND_S:g}, got "
                             f"{self.quiet_step_send_s}")

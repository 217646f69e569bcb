"""When restarting the workers cannot help, ``trainwarden run`` (agent/launch/run.py) stops the job and says why: the
part of the run that reads each failed round's exits (the launcher's ``failed`` event, agent/launch/elastic.py) for
that verdict.

* **Resume blocked**: workers exit with ``EXIT_RESUME_BLOCKED`` (agent/shared/contract.py): the job's checkpoints
  exist but none can be read or loaded; starting over would lose them.
* **Numeric stop**: workers exit with ``EXIT_NUMERIC_STOP``: their numeric policy stops on non-finite values a
  restart would compute again.
* **Configuration error**: a round fails before its first step exactly as the previous one did (a missing file, a
  bad flag, an import error), not a fault a restart cures.

``StopVerdict`` is a part the run owns: it is told each failed round (with whether a step was made in it and which
processes the agent killed itself) and each ``resume_blocked`` checkpoint record; ``wake`` ends the supervisor's wait
once it decided; ``stop`` says why and ends the job through the run's ``transition``.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Callable, TextIO

from trainwarden.agent.common import exit_codes
from trainwarden.agent.common.job_lifecycle import JobPhase
from trainwarden.agent.incidents.worker_failures import describe_exit
from trainwarden.agent.shared.contract import EXIT_ABORTED, EXIT_NUMERIC_STOP, EXIT_RESUME_BLOCKED

__all__ = ["StopVerdict"]


class StopVerdict:
    """Whether the job stops for good rather than restart (module docstring). ``reason`` is None until it does."""

    def __init__(self, *, job: str, numeric_policy: str, log_path: Path, out: TextIO) -> None:
        self.job, self.numeric_policy, self.log_path, self._out = job, numeric_policy, log_path, out
        self.reason: str | None = None  # why restarting does not help (any of the three)
        self.resume_blocked: str | None = None
        """Why the workers may not resume (their checkpoints cannot be read or loaded): the job stops, no restart."""
        self.numeric_stop: str | None = None
        self._resume_detail = ""
        self._startup_failure: tuple | None = None  # how the last round failed, if before its first step
        self.wake: threading.Event | None = None  # the supervisor's wait (its signals' event)

    def round_failed(self, failures: list[dict], *, in_round: bool, killed: Callable[[int], bool]) -> bool:
        """A worker round failed with ``failures`` (the launcher's records: rank, exit code, message, pid); whether
        a step was completed in it (``in_round``); ``killed``: a pid the node agent killed itself. True: the job
        stops on the workers' own verdict (resume blocked, numeric stop): the failure is not one to record."""
        if self._check_resume_blocked(failures) or self._check_numeric_stop(failures):
            return True
        self._check_deterministic(failures, in_round, killed)
        return False

    def checkpoint_detail(self, detail: str) -> None:
        """The committing rank's reason for a ``resume_blocked`` record, in full."""
        self._resume_detail = detail

    def stop(self, transition: Callable[..., None], failures=None) -> int:
        """Say why the job stops and end it (``transition``, the run's); the command's exit code. ``failures``: the
        run's worker-failure recorder (None without the agent)."""
        if self.resume_blocked is not None:  # recorded by the agent as a resume_blocked incident
            return self._stop_resume_blocked(transition)
        if self.numeric_stop is not None:  # recorded by the agent as a numeric incident
            return self._stop_numeric(transition)
        print(f"trainwarden: {self.reason}", file=self._out, flush=True)
        transition(JobPhase.FAILED, "configuration error: " + self.reason[:200])
        if failures is not None:
            failures.job_failed("configuration error: the workers fail the same way before any step")
        return exit_codes.EXIT_CONFIG

    def _decided(self) -> None:
        if self.wake is not None:
            self.wake.set()

    def _check_resume_blocked(self, failures: list[dict]) -> bool:
        """Workers that exit with EXIT_RESUME_BLOCKED found checkpoints they may not start without: not a crash
        (no incident of that kind) and no restart; the job stops and says why (their own last words)."""
        blocked = [f for f in failures if int(f["exitcode"]) == EXIT_RESUME_BLOCKED]
        if not blocked:
            return False
        said = next((str(f.get("message")) for f in blocked if f.get("message")), "")
        self.resume_blocked = said or "its checkpoints exist but none could be read or loaded"
        self.reason = self.resume_blocked
        self._decided()
        return True

    def _check_numeric_stop(self, failures: list[dict]) -> bool:
        """Workers that exit with EXIT_NUMERIC_STOP computed non-finite values their numeric policy stops on: a
        restart would compute them again, so the job stops and says why (the first rank's words)."""
        stopped = [f for f in failures if int(f["exitcode"]) == EXIT_NUMERIC_STOP]
        if not stopped:
            return False
        said = next((str(f.get("message")) for f in stopped if f.get("message")), "")
        self.numeric_stop = self.reason = said or "the training computed values that are not finite"
        self._decided()
        return True

    def _stop_numeric(self, transition) -> int:
        why = (self.numeric_stop or "")[:1500]
        print(f"trainwarden: the job stopped on non-finite values (--numeric-policy {self.numeric_policy}): {why}\n"
              f"trainwarden: no restart was spent. `trainwarden incidents --job {self.job}` has the numeric "
              f"incident; the workers' own output is in {self.log_path}", file=self._out, flush=True)
        transition(JobPhase.FAILED, "numeric stop: " + why[:300])
        return exit_codes.EXIT_NUMERIC_STOP

    def _stop_resume_blocked(self, transition) -> int:
        why = (self._resume_detail or self.resume_blocked or "")[:1500]
        print(f"trainwarden: the job stopped rather than start over: {why}\ntrainwarden: no restart was spent. "
              f"`trainwarden checkpoints --job {self.job}` lists its checkpoints and why each was set aside; "
              f"the workers' own output is in {self.log_path}", file=self._out, flush=True)
        transition(JobPhase.FAILED, "resume blocked: " + why[:300])
        return exit_codes.EXIT_RESUME_BLOCKED

    def _check_deterministic(self, failures: list[dict], in_round: bool, killed: Callable[[int], bool]) -> None:
        """A round that fails before its first step exactly as the previous one did is a configuration error
        (a missing file, a bad flag, an import error), not a fault a restart cures."""
        own = tuple(sorted((int(f["global_rank"]), int(f["exitcode"]), str(f.get("message") or "")[:300])
                           for f in failures if int(f["exitcode"]) not in (-signal.SIGTERM, EXIT_ABORTED)
                           and not killed(int(f.get("pid") or 0))))
        if in_round or not own:
            self._startup_failure = None
            return
        if own == self._startup_failure and self.reason is None:
            rank, code, message = own[0]
            self.reason = (f"the workers failed the same way twice before their first step (rank {rank}: "
                           f"{describe_exit(code)}{f': {message}' if message else ''}); this is a "
                           "configuration error, not a transient fault: not restarting. See the job's log "
                           f"({self.log_path}) for the workers' own output.")
            self._decided()
        self._startup_failure = own

"""Exit codes of the trainwarden CLI and of workers, as named constants.

Shell users and supervisors (systemd, Kubernetes) act on these, so they never change meaning.
"""

from trainwarden.agent.shared.contract import EXIT_ABORTED  # the workers' code, defined with the protocol

__all__ = [
    "EXIT_OK", "EXIT_JOB_FAILED", "EXIT_RESUME_BLOCKED", "EXIT_USAGE", "EXIT_ETCD_UNAVAILABLE", "EXIT_LAUNCH_FAILED", "EXIT_AGENT_UNAVAILABLE", "EXIT_CONFIG",
    "EXIT_ABORTED", "EXIT_INTERRUPTED", "EXIT_TERMINATED", "EXIT_CHECKPOINT_CORRUPT", "EXIT_NUMERIC_STOP",
]

EXIT_OK = 0
"""The job (or command) completed."""
EXIT_JOB_FAILED = 1
"""The workers failed and the restart budget is spent."""
EXIT_USAGE = 2
"""Bad command line or configuration: fix the input; retrying does not help."""
EXIT_ETCD_UNAVAILABLE = 3
"""etcd could not be reached or started: retry once it is up."""
EXIT_LAUNCH_FAILED = 4
"""torchrun could not be started."""
EXIT_CONFIG = 6
"""The job cannot start as configured (a missing script, a malformed fault spec, workers that fail the same
way before their first step twice): fix it; restarting does not help."""
EXIT_RESUME_BLOCKED = 7
"""The job's checkpoints exist (or were committed) but none can be read or loaded: it stopped rather than
start over, and spent no restart. Fix the storage or put a checkpoint back (`trainwarden checkpoints`),
then resume; `--allow-fresh-start` (the reference job's) starts over on purpose."""
EXIT_CHECKPOINT_CORRUPT = 8
"""`trainwarden checkpoints --verify`: a committed checkpoint's bytes differ from the sums recorded at commit."""
EXIT_NUMERIC_STOP = 9
"""The job stopped on non-finite values (NaN, Inf) in its loss or gradients: ``--numeric-policy stop``, or
non-finite again soon after a rollback. No restart was spent: a restart would compute them again. The numeric
incident names the step and the first rank."""
EXIT_AGENT_UNAVAILABLE = 5
"""No node agent answers on the socket (`trainwarden status/top`, `agent --check`): start one, or retry."""
EXIT_INTERRUPTED = 130
"""Stopped by Ctrl-C (SIGINT)."""
EXIT_TERMINATED = 143
"""Stopped by SIGTERM."""

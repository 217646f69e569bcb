"""Whether a recorded process still runs: its pid and its start time, and a zombie does not count.

Records name a process by pid and start time (the launchers' records, a run's record, the scratch directories'
owner marks, the job's membership), since a pid is reused. A process that was SIGKILLed stays a zombie until its
parent reaps it; when the parent died with it (a power loss of the node, a kill of everything on it), that is PID
1, which reaps it when it gets to it: 1.4 s on this project's VM, never under an init that does not reap. Until
then it still has its pid and its start time, and a new run that took it for alive refused to start or kept its
leftovers (session 36's soak). ``running_since`` is the one answer to "when did the process ``pid`` start, if it
still runs".
"""

from __future__ import annotations

import psutil

__all__ = ["running_since"]


def running_since(pid: int) -> float | None:
    """When process ``pid`` started (``psutil``'s ``create_time``); None when no such process runs: gone, or a
    zombie. Other ``psutil`` errors (access denied) are the caller's to judge."""
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
    except psutil.NoSuchProcess:  # ZombieProcess too
        return None

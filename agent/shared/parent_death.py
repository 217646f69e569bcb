"""Children die with their supervisor: Linux's parent-death signal, for every process trainwarden starts.

``trainwarden run`` starts torchrun (the elastic launcher) and an embedded etcd; torchrun starts the
workers. If ``trainwarden run`` is killed hard (SIGKILL, the OOM killer), nothing it started may train on
(orphans would keep writing the same checkpoint directory beside a rerun). So each child asks the kernel
for a signal when its parent dies (``prctl(PR_SET_PDEATHSIG)``):

- the elastic launcher asks for SIGTERM: torchrun's own handler then stops its workers (SIGTERM, then
  SIGKILL), for any script;
- workers that use the runtime ask for SIGKILL when the launcher dies (the launcher tells them through
  ``LAUNCHER_PID_ENV``), in case the launcher itself was killed hard;
- the embedded etcd, which cannot ask itself, is started through ``exec_dying_with_parent``'s shim.

The request races with the parent's death, so each caller passes the pid its parent must have and, if the
parent is already someone else, signals itself at once. The signal follows the parent *thread* that
started the process: trainwarden starts its children from the main thread. Elsewhere than Linux this is a
no-op (False).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

__all__ = ["LAUNCHER_PID_ENV", "SUPERVISOR_PID_ENV", "die_with_parent", "exec_dying_with_parent"]

SUPERVISOR_PID_ENV = "TRAINWARDEN_SUPERVISOR_PID"
"""Set by ``trainwarden run`` for the launcher: the pid the launcher's parent must be."""
LAUNCHER_PID_ENV = "TRAINWARDEN_LAUNCHER_PID"
"""Set by the launcher for its workers: the pid their parent must be."""

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int, expected_parent: int) -> bool:
    """Have the kernel send `sig` to this process when its parent dies; True when that is arranged."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != expected_parent:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)
    return True


_SHIM = (
    "import ctypes,os,sys\n"
    "sig,parent=int(sys.argv[1]),int(sys.argv[2])\n"
    "try:\n ctypes.CDLL(None).prctl(1,sig,0,0,0)\nexcept Exception:\n pass\n"
    "if os.getppid()!=parent:\n os.kill(os.getpid(),sig)\n"
    "os.execvp(sys.argv[3],sys.argv[3:])\n"
)


def exec_dying_with_parent(cmd: list[str], sig: int = signal.SIGTERM) -> list[str]:
    """`cmd` wrapped so that the program it runs gets `sig` when the calling process dies (the parent-death
    signal survives exec). Called from another thread than the main one, `cmd` is returned as it is: the
    kernel would signal the child when that *thread* ends (an etcd restarted from a timer thread died the
    moment the timer returned)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return list(cmd)
    return [sys.executable, "-S", "-c", _SHIM, str(int(sig)), str(os.getpid()), *cmd]

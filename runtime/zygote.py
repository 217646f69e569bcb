"""Warm workers: workers fork from a process that has torch imported already (``--warm-workers``, the default).

A restart's cost on this machine is mostly eight new interpreters importing torch at once (BENCHMARKS.md,
"Restart breakdown": 9.5 s of 12.6 s). With warm workers the launcher (agent/launch/elastic.py) starts one
*zygote* next to torch's agent: a process that imports torch, the runtime and the top-level imports of the job's
script (read from its source, never executed) and then waits on a unix socket, single-threaded. torch's agent
still starts one process per rank, but that process is this module's *client*: a plain interpreter that does not
import torch. It connects to the zygote, hands over its argv, environment, working directory and standard
streams (SCM_RIGHTS), and the zygote forks the real worker, which runs the job's script as ``__main__`` with
them. The client stays as the worker's stand-in for torch's agent:

* a signal sent to the client (SIGTERM from torch's agent, SIGUSR1...) is forwarded to the worker;
* when the worker exits, the zygote sends its wait status and the client exits the same way (the same code,
  or killed by the same signal), so torch's agent sees the failure it would have seen;
* when the client dies (SIGKILL), the zygote kills the worker; when the zygote dies, the workers die with it
  (``PR_SET_PDEATHSIG``).

The worker is a fresh copy of a zygote that never trained: it reseeds Python's, NumPy's and torch's default
generators from the OS as a new interpreter would, and applies ``OMP_NUM_THREADS``. Its pid is not the one
torch's agent knows; the zygote writes ``<map dir>/<worker pid>`` holding the client's pid, so the supervisor
can tell that a telemetry stream (identified by its kernel-reported pid) is one of its round's workers.

The first round's workers are started beside the zygote while it imports: their clients wait for its socket
(``_wait_for_zygote``), so the first round forks too and the node imports torch once instead of once per rank.
Whatever fails on the way (a zygote that will not fork and says so in ``<socket>.off``, one that died or took longer
than ``TRAINWARDEN_WARM_WAIT_S``, a refused connection) the client falls back to ``exec`` of a normal interpreter: a
cold start, as without this option.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import socket
import struct
import sys

from trainwarden.agent.shared.contract import WARM_PARENT_PID_ENV
from trainwarden.agent.shared.parent_death import die_with_parent

from .zygote_client import CLIENT_PID_ENV, FORWARDED_SIGNALS, client_main, recv_exact, send_frame

__all__ = ["client_main", "worker_title"]

_BASE_IMPORTS = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.tensor",
                 "torch.distributed.fsdp", "numpy", "trainwarden.runtime")
"""What every zygote imports besides the script's own top-level imports. Not ``torch.distributed.pipelining``:
importing it creates ``$TMPDIR/torchinductor_<user>``, litter a script that never imports it would not leave
(it is preloaded when the script imports it)."""


# ---- the zygote -----------------------------------------------------------------------------------------------


def _top_level_imports(argv: list[str]) -> list[str]:
    """Absolute modules the job's script imports at its top level (from its source; nothing of it runs)."""
    try:
        if argv and argv[0] == "-m":
            import importlib.util

            spec = importlib.util.find_spec(argv[1])
            source_path = spec.origin if spec else None
        else:
            source_path = argv[0] if argv else None
        if not source_path or not source_path.endswith(".py"):
            return []
        with open(source_path) as f:
            tree = ast.parse(f.read())
    except Exception:
        return []
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _unsafe_to_fork() -> str | None:
    """Why forking workers from this process would be unsafe, after its imports (None: it is safe). A child
    forked from a process with other threads inherits their locks but not the threads; one forked after CUDA
    was initialised cannot use CUDA."""
    import threading

    # Python threads: a fork copies the locks they may hold (logging's, the import lock) but not them. Native
    # pools that libraries start at import (OpenBLAS without OMP_NUM_THREADS=1) re-arm through their
    # pthread_atfork handlers, as they do under torch's DataLoader workers.
    threads = threading.active_count()
    if threads > 1:
        return f"the job's imports started {threads - 1} Python thread(s) in the process workers would fork from"
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return "the job's imports initialised CUDA, which a forked worker could not use"
    except Exception:
        pass
    return None


def _pdeathsig(sig: int = signal.SIGKILL) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class _Job:
    """What a forked worker runs (returned from the serve loop in the child only)."""

    def __init__(self, request: dict, fds: list[int], parent: int) -> None:
        self.request, self.fds = request, fds
        self.parent = parent
        """The zygote's pid: the worker dies with it, even when it died before the worker asked (``_become``)."""


def serve(path: str, map_dir: str, script: list[str]) -> _Job | None:
    """Import, then fork a worker per client until the listening socket is closed; in a child, its job."""
    problem = _preload(script)
    if problem is not None:
        print(f"trainwarden: warm workers are off for this job: {problem}; its workers start cold",
              file=sys.stderr, flush=True)
        with open(path + ".off", "w") as f:  # the clients waiting for the socket start cold now
            f.write(problem + "\n")
        return None
    os.makedirs(map_dir, exist_ok=True)
    return _Zygote(_listen(path), map_dir).run()


def _preload(script: list[str]) -> str | None:
    """Import what every worker would (torch, the runtime, the script's top-level imports); why forking from
    this process would be unsafe after that, or None."""
    import importlib

    for name in (*_BASE_IMPORTS, *_top_level_imports(script)):
        try:
            importlib.import_module(name)
        except Exception:  # a module the job imports lazily or conditionally: the worker imports it itself
            pass
    return _unsafe_to_fork()


def _listen(path: str) -> socket.socket:
    """The zygote's listening socket at ``path``, in place only once it accepts."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # clients never see a socket that does not accept yet
    listener.listen(64)
    return listener


class _Zygote:
    """The serve loop: it accepts clients and forks their workers, reports each worker's exit to its client, and
    kills the worker of a client that died. Single-threaded; SIGCHLD wakes it through a pipe."""

    def __init__(self, listener: socket.socket, map_dir: str) -> None:
        self.listener, self.map_dir = listener, map_dir
        self.r_wake, self.w_wake = os.pipe()
        os.set_blocking(self.w_wake, False)
        self.children: dict[int, socket.socket | None] = {}
        """Worker pid -> its client's connection; None once the client is gone and the worker killed, until it is
        reaped (a closed socket must not stay here: ``select`` raises on its fd of -1, and the zygote would die)."""
        self.by_conn: dict[int, int] = {}  # connection fd -> worker pid
        self.off: str | None = None  # why this zygote forks no more workers (its own serve the rest of their run)
        signal.signal(signal.SIGCHLD, self._wake)

    def _wake(self, *_) -> None:
        try:
            os.write(self.w_wake, b"x")
        except OSError:  # the pipe is full: a wake-up is pending already
            pass

    def run(self) -> _Job | None:
        """Serve; returns only in a forked worker, with its job."""
        import select

        while True:
            try:
                live = [c for c in self.children.values() if c is not None]
                ready, _, _ = select.select([self.listener, self.r_wake, *live], [], [])
            except InterruptedError:
                continue
            if self.r_wake in ready:
                os.read(self.r_wake, 4096)
            self._reap()
            self._drop_gone([c for c in ready if c not in (self.listener, self.r_wake)])
            if self.listener in ready:
                job = self._accept()
                if job is not None:
                    return job

    def _reap(self) -> None:
        """Workers that exited: their wait status to their client, which exits the same way."""
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = self.children.pop(pid, None)
            if conn is not None:
                self.by_conn.pop(conn.fileno(), None)
                try:
                    send_frame(conn, {"status": status})
                except OSError:
                    pass
                conn.close()
            try:
                os.unlink(os.path.join(self.map_dir, str(pid)))
            except OSError:
                pass

    def _drop_gone(self, conns: list[socket.socket]) -> None:
        """Clients whose connection closed (SIGKILL): their workers must not outlive them."""
        for conn in conns:
            if conn.fileno() < 0:
                continue
            try:
                gone = conn.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                gone = True
            if gone:
                pid = self.by_conn.pop(conn.fileno(), None)
                if pid is not None:
                    self.children[pid] = None  # still ours to reap (its map entry goes then)
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                conn.close()

    def _accept(self) -> _Job | None:
        """One client: its request, then a worker forked for it; in that worker, its job."""
        conn, _ = self.listener.accept()
        try:
            client_pid, request, fds = _receive(conn)
        except (OSError, ConnectionError, ValueError):
            conn.close()
            return None
        problem = self.off or _unsafe_to_fork()  # checked before every fork, not only after the imports
        if problem:
            if not self.off:
                print(f"trainwarden: warm workers are off for this job from now: {problem}; restarted workers "
                      f"start cold", file=sys.stderr, flush=True)
                self.off = problem
            for fd in fds:
                os.close(fd)
            conn.close()  # the client starts its worker cold
            return None
        return self._fork(conn, client_pid, request, fds)

    def _fork(self, conn: socket.socket, client_pid: int, request: dict, fds: list[int]) -> _Job | None:
        sys.stdout.flush()
        sys.stderr.flush()
        zygote = os.getpid()
        pid = os.fork()
        if pid == 0:  # the worker
            self.listener.close()
            os.close(self.r_wake)
            os.close(self.w_wake)
            for other in self.children.values():
                if other is not None:
                    other.close()
            conn.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            return _Job(request, fds, zygote)
        for fd in fds:
            os.close(fd)
        with open(os.path.join(self.map_dir, str(pid)), "w") as f:
            f.write(str(client_pid))
        self.children[pid] = conn
        self.by_conn[conn.fileno()] = pid
        print(f"trainwarden: warm worker pid {pid} forked for rank {request['env'].get('RANK', '?')} (client pid "
              f"{client_pid})", file=sys.stderr, flush=True)
        try:
            send_frame(conn, {"pid": pid})
        except OSError:
            pass
        return None


def _receive(conn: socket.socket) -> tuple[int, dict, list[int]]:
    """The client's pid (the kernel's word), its request and its three standard streams; a request that does not
    arrive whole raises (OSError, ConnectionError, ValueError) with the descriptors it brought closed."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    client_pid = struct.unpack("3i", creds)[0]
    # the descriptors ride on the frame's first bytes: read those with recv_fds (a plain recv would drop them)
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    try:
        if len(head) < 4:
            head += recv_exact(conn, 4 - len(head))
        (n,) = struct.unpack("!I", head)
        request = json.loads(recv_exact(conn, n))
        if len(fds) != 3:
            raise ValueError(f"expected the client's 3 standard streams, got {len(fds)} descriptors")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return client_pid, request, fds


def _arm_auto_instrumentation() -> None:
    """Arm the runtime's auto-instrumentation in this child, as the worker bootstrap's ``sitecustomize`` does
    at a cold worker's start (which a forked child never has). The client that asked for it ran that
    bootstrap itself and marked its environment as its own; this child is the worker, so the mark is its.
    The one place the agent's code imports the runtime: from here on this process is the user's worker."""
    from trainwarden.agent.shared.contract import AUTO_OWNER_ENV

    if os.environ.get(AUTO_OWNER_ENV) == str(os.environ.get(CLIENT_PID_ENV, "")):
        os.environ.pop(AUTO_OWNER_ENV)
    os.environ.pop(CLIENT_PID_ENV, None)
    try:
        from trainwarden.runtime.auto import bootstrap

        bootstrap()
    except Exception as exc:
        print(f"trainwarden: auto-instrumentation is off for this worker ({type(exc).__name__}: {exc})",
              file=sys.stderr, flush=True)


def worker_title(env, argv: list[str]) -> str:
    """What ``ps`` and ``pgrep -f`` show for a warm worker: who it is (its command line is the zygote's, and
    ``/proc/PID/environ`` holds the zygote's environment, not the rank's)."""
    from trainwarden.agent.shared.contract import JOB_ENV

    who = " ".join(f"{name}={env[key]}" for name, key in (("job", JOB_ENV), ("rank", "RANK"),
                                                         ("local_rank", "LOCAL_RANK")) if env.get(key))
    return f"trainwarden worker {who}: {' '.join(argv)}"[:1024]


def _title_setter():
    """A function that titles this process (``setproctitle``: what ``ps``/``pgrep -f`` show) and names it (``comm``:
    ``tw-rank-R``, 15 bytes at most), or None. Made before the environment is replaced: setproctitle finds the
    memory it rewrites from the original argv and environ on first use, and once ``os.environ.clear()`` has moved
    the environment it can only set the short name."""
    try:
        import setproctitle

        setproctitle.getproctitle()  # its setup, now
    except Exception:  # a title is a convenience: never a reason for the worker not to run
        return None

    def set_title(argv: list[str]) -> None:
        try:
            setproctitle.setproctitle(worker_title(os.environ, argv))
            setproctitle.setthreadtitle(f"tw-rank-{os.environ.get('RANK', '?')}"[:15])
        except Exception:
            pass

    return set_title


def _become(job: _Job) -> None:
    """In the forked child: take the client's streams, environment and arguments, reseed, run the script."""
    die_with_parent(signal.SIGKILL, job.parent)  # a zygote killed right after the fork: this worker goes too
    set_title = _title_setter()
    for target, fd in zip((0, 1, 2), job.fds):
        os.dup2(fd, target)
        os.close(fd)
    request = job.request
    os.environ.clear()
    os.environ.update(request["env"])
    from trainwarden.agent.shared.parent_death import LAUNCHER_PID_ENV

    if LAUNCHER_PID_ENV in os.environ:  # the runtime dies with its parent: here the zygote, not torchrun
        os.environ[LAUNCHER_PID_ENV] = str(os.getppid())
    os.chdir(request["cwd"])
    if set_title is not None:
        set_title(request["argv"])
    _arm_auto_instrumentation()
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import random

    random.seed()
    try:
        import numpy

        numpy.random.seed(int.from_bytes(os.urandom(4), "little"))
    except Exception:
        pass
    try:
        import torch

        torch.seed()
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
    except Exception:
        pass
    import runpy

    argv = list(request["argv"])
    if argv and argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        path, map_dir, script = sys.argv[2], sys.argv[3], sys.argv[4:]
        parent = os.environ.pop(WARM_PARENT_PID_ENV, "")
        if parent.isdigit():  # the launcher (torchrun) is gone: so is the zygote, even if it went before this line
            die_with_parent(signal.SIGTERM, int(parent))
        else:
            _pdeathsig(signal.SIGTERM)
        job = serve(path, map_dir, script)
        if job is None:
            return
        _become(job)  # SystemExit and exceptions end this process as they would a fresh interpreter
        return
    client_main(sys.argv[1:])


if __name__ == "__main__":
    main()

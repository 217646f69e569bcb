"""The warm workers' client (runtime/zygote.py has the whole story), and the framing both sides speak.

torch's agent starts ``python -m trainwarden.runtime.zygote SCRIPT...`` per rank: this client, an interpreter that
never imports torch. It hands its argv, environment, working directory and standard streams to the zygote, which
forks the worker, then stands in for the worker before torch's agent (signals forwarded; the worker's end becomes
its own). Without a zygote it ``exec``s the script: a cold start.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

from trainwarden.agent.shared.contract import WARM_SOCKET_ENV, WARM_WAIT_ENV, WARM_ZYGOTE_PID_ENV

__all__ = ["CLIENT_PID_ENV", "FORWARDED_SIGNALS", "client_main", "recv_exact", "recv_frame", "send_frame"]

CLIENT_PID_ENV = "TRAINWARDEN_WARM_CLIENT_PID"
"""The client's pid, in the environment it hands the zygote (auto-instrumentation's mark is the client's)."""
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
              signal.SIGCONT)

# ---- framing: 4-byte length + JSON --------------------------------------------------------------------------


def send_frame(sock: socket.socket, obj: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    frame = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(sock, [frame], fds)
    else:
        sock.sendall(frame)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def recv_frame(sock: socket.socket) -> dict:
    (n,) = struct.unpack("!I", recv_exact(sock, 4))
    return json.loads(recv_exact(sock, n))


# ---- the client: torch's agent starts one per rank ------------------------------------------------------------


def _wait_for_zygote(path: str) -> bool:
    """Whether the zygote's socket is there, waiting while the zygote still imports (the first round's workers
    are started beside it): not when it said it will not fork (``<path>.off``), died, or took longer than
    ``TRAINWARDEN_WARM_WAIT_S`` (default 120 s; 0: never wait, the first round starts cold)."""
    import time

    try:
        budget = float(os.environ.get(WARM_WAIT_ENV, "120"))
        zygote = int(os.environ.get(WARM_ZYGOTE_PID_ENV, "0"))
    except ValueError:
        budget, zygote = 0.0, 0
    deadline = time.monotonic() + budget
    while not os.path.exists(path):
        if os.path.exists(path + ".off") or time.monotonic() >= deadline or not _alive(zygote):
            return False
        time.sleep(0.02)
    return True


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: its parent, the launcher, reaps it only when it stops)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def client_main(argv: list[str]) -> None:
    """``python -m trainwarden.runtime.zygote [-m MODULE | SCRIPT] ARGS...``: run it in a warm worker."""
    path = os.environ.get(WARM_SOCKET_ENV)
    conn = None
    if path and _wait_for_zygote(path):
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(path)
            env = dict(os.environ, **{CLIENT_PID_ENV: str(os.getpid())})
            send_frame(conn, {"argv": argv, "env": env, "cwd": os.getcwd()}, [0, 1, 2])
            reply = recv_frame(conn)
            child = int(reply["pid"])
        except (OSError, ConnectionError, ValueError, KeyError):
            if conn is not None:
                conn.close()
            conn = None
    if conn is None:  # no zygote: a cold start, exactly what torch's agent would have run
        os.execv(sys.executable, [sys.executable, *argv])

    def forward(signum, _frame):
        try:
            os.kill(child, signum)
        except OSError:
            pass

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    try:
        status = int(recv_frame(conn)["status"])
    except (OSError, ConnectionError, ValueError, KeyError):
        status = 1 << 8  # the zygote died: the worker died with it
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset (EINVAL)
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    sys.exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)

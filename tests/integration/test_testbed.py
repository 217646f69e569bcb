"""The multi-host test bed itself (tests/testbed.py): isolated nodes that reach each other, a 3-member etcd
cluster that survives a member's loss, and kill, partition, heal and degrade (the whole link, one direction,
one pair of hosts) doing what they say, measured with TCP transfers. Teardown leaves no namespace and no
process behind."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed import TestBed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

if TestBed.unavailable():
    pytest.skip(TestBed.unavailable(), allow_module_level=True)

ECHO_SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], 7000))
while True:
    c, _ = s.accept()
    n = 0
    while True:
        b = c.recv(65536)
        if not b:
            break
        n += len(b)
    c.sendall(str(n).encode())
    c.close()
"""

SEND = """
import socket, sys, time
t = time.monotonic()
c = socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[3]))
c.sendall(b"x" * int(sys.argv[2]))
c.shutdown(socket.SHUT_WR)
got = c.recv(100)
print(got.decode(), time.monotonic() - t)
"""


def _send(bed, src, dst, size, timeout=20.0):
    result = bed.run(src, [sys.executable, "-c", SEND, bed.address(dst), str(size), str(timeout)],
                     timeout=timeout + 10)
    if result.returncode != 0:
        return None
    received, seconds = result.stdout.split()
    assert int(received) == size
    return float(seconds)


def test_nodes_reach_each_other_and_kill_partition_heal_degrade_work(tmp_path):
    bed = TestBed(nodes=2, workdir=tmp_path / "bed")
    with bed:
        server = bed.spawn("n1", [sys.executable, "-c", ECHO_SERVER, bed.address("n1")], log=tmp_path / "echo.log")
        deadline = time.monotonic() + 20
        baseline = None
        while baseline is None and time.monotonic() < deadline:
            baseline = _send(bed, "n0", "n1", 512 * 1024, timeout=2.0)
        assert baseline is not None, (tmp_path / "echo.log").read_text()
        # the machine's own network is out of reach from a node: only the bed's subnet exists there
        routes = bed.run("n0", ["ip", "route"]).stdout
        assert routes.strip().splitlines() == [f"10.213.0.0/24 dev eth0 proto kernel scope link src {bed.address('n0')}"]

        bed.degrade("n1", rate="4mbit")  # 512 KiB at 4 Mbit/s: about a second
        slow = _send(bed, "n0", "n1", 512 * 1024)
        assert slow is not None and slow > 10 * baseline, (slow, baseline)
        bed.restore_link("n1")

        bed.partition("n1")
        assert _send(bed, "n0", "n1", 1024, timeout=2.0) is None
        assert server.poll() is None  # processes live on behind the partition
        bed.heal("n1")
        assert _send(bed, "n0", "n1", 1024, timeout=5.0) is not None

        killed = bed.kill("n1")
        assert killed and server.poll() is not None
        assert _send(bed, "n0", "n1", 1024, timeout=2.0) is None
    assert bed.leftovers() == []
    assert bed.tag not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _mbit_s(bed, src, dst, size=2 * 1024 * 1024):
    """Throughput of one TCP transfer of ``size`` bytes from host ``src`` to host ``dst`` (its echo server)."""
    seconds = _send(bed, src, dst, size, timeout=30.0)
    assert seconds is not None, f"{src} -> {dst} failed"
    return size * 8 / seconds / 1e6


def test_degrade_limits_one_direction_or_one_pair_and_nothing_else(tmp_path):
    """Each limit shows in a transfer where it applies (about the rate) and not elsewhere (far above it); the
    margins are ratios to the configured rate: the unlimited bridge moves gigabits a second even on a busy
    machine."""
    rate = 20  # Mbit/s: a 2 MB transfer takes about 0.8 s through the limit
    bed = TestBed(nodes=3, workdir=tmp_path / "bed")
    with bed:
        for n in bed.hosts:
            bed.spawn(n, [sys.executable, "-c", ECHO_SERVER, bed.address(n)], log=tmp_path / f"echo-{n}.log")
        deadline = time.monotonic() + 20
        while not all(_send(bed, "n0", n, 1024, timeout=2.0) for n in ("n1", "n2")):
            assert time.monotonic() < deadline, "the echo servers did not come up"
            time.sleep(0.2)

        def expect(limited=(), free=()):
            for src, dst in limited:
                mbit = _mbit_s(bed, src, dst)
                assert rate / 4 < mbit < rate * 1.5, f"{src} -> {dst}: {mbit:.1f} Mbit/s through a {rate} Mbit/s limit"
            for src, dst in free:
                mbit = _mbit_s(bed, src, dst)
                assert mbit > rate * 10, f"{src} -> {dst}: {mbit:.1f} Mbit/s where no limit applies"

        expect(free=[("n0", "n2")])
        bed.degrade("n2", f"{rate}mbit")  # the whole link, both ways
        expect(limited=[("n0", "n2"), ("n2", "n0")], free=[("n0", "n1")])
        assert bed.link_limits("n2") == {("out", None): f"{rate}mbit", ("in", None): f"{rate}mbit"}
        bed.restore_link("n2")
        expect(free=[("n2", "n0")])

        bed.degrade("n2", f"{rate}mbit", direction="out")  # what n2 sends, to anyone
        expect(limited=[("n2", "n0"), ("n2", "n1")], free=[("n0", "n2")])
        bed.restore_link("n2")
        bed.degrade("n2", f"{rate}mbit", direction="in")  # what n2 receives, from anyone
        expect(limited=[("n1", "n2")], free=[("n2", "n0")])
        bed.restore_link("n2")

        bed.degrade("n0", f"{rate}mbit", peer="n2")  # only between n0 and n2, both ways
        expect(limited=[("n0", "n2"), ("n2", "n0")], free=[("n0", "n1"), ("n1", "n2"), ("n1", "n0")])
        with pytest.raises(ValueError, match="do not mix"):
            bed.degrade("n0", "1mbit")
        bed.restore_link("n2")  # the peer's restore lifts the pair's limit held on n0's devices
        assert bed.link_limits("n0") == {}
        expect(free=[("n0", "n2"), ("n2", "n0")])

        bed.degrade("n0", f"{rate}mbit", direction="out", peer="n2")  # n0 -> n2 only
        expect(limited=[("n0", "n2")], free=[("n2", "n0"), ("n0", "n1")])
        bed.restore_link("n0")
        expect(free=[("n0", "n2")])
    assert bed.leftovers() == []


def test_the_etcd_cluster_serves_from_every_node_and_survives_one_member(tmp_path):
    bed = TestBed(nodes=1, etcd_members=3, workdir=tmp_path / "bed")
    with bed:
        ctl = [str(Path(sys.executable).parent / "etcdctl"), "--endpoints",
               bed.etcd_endpoints, "--dial-timeout", "2s", "--command-timeout", "5s"]
        assert bed.run("n0", [*ctl, "put", "/k", "v1"]).returncode == 0
        bed.kill("e0")
        assert not bed.etcd_healthy("e0")
        # two of three keep the quorum: writes go on from the node
        put = bed.run("n0", [*ctl, "put", "/k", "v2"])
        assert put.returncode == 0, put.stderr
        assert bed.run("n0", [*ctl, "get", "/k", "--print-value-only"]).stdout.strip() == "v2"
        bed.start_etcd_member("e0")  # it comes back with its data and catches up
        deadline = time.monotonic() + 30
        while not bed.etcd_healthy("e0") and time.monotonic() < deadline:
            time.sleep(0.3)
        assert bed.etcd_healthy("e0")
    assert bed.leftovers() == []


def test_a_node_advertises_the_address_that_routes_to_etcd_not_its_host_name(tmp_path):
    """All simulated nodes share the machine's host name; `trainwarden run` picks each node's own address
    (and gloo's interface) from the route to etcd."""
    code = ("import sys; from trainwarden.agent.common.netaddr import interface_of, route_address; "
            "a = route_address(sys.argv[1]); print(a, interface_of(a))")
    with TestBed(nodes=2, workdir=tmp_path / "bed") as bed:
        for node, peer in (("n0", "n1"), ("n1", "n0")):
            result = bed.run(node, [sys.executable, "-c", code, bed.address(peer)], check=True)
            assert result.stdout.split() == [bed.address(node), "eth0"]

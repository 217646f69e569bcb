"""The multi-host test bed itself (tests/testbed.py): isolated nodes that reach each other, a 3-member etcd
cluster that survives a member's loss, and kill, partition, heal and degrade doing what they say. Teardown
leaves no namespace and no process behind."""

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

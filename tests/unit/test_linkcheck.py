"""Link checks (agent/linkcheck): the schedule never puts a node in two probes at once; the verdict names a
node and its direction, a pair, or nothing, on jobs of several sizes; and the probe server measures a real
loopback link, refuses a wrong token and caps what a request may ask."""

from __future__ import annotations

import itertools
import json
import socket

import pytest

from trainwarden.agent.linkcheck import ProbeServer, check_links, probe_targets
from trainwarden.agent.linkcheck.probe import LinkSample, ProbeError, measure_link, request_probe
from trainwarden.agent.linkcheck.verdict import judge, schedule

pytestmark = pytest.mark.timeout(60)

FAST, SLOW = 8000.0, 20.0


def samples(nodes: list[str], slow: set[tuple[str, str]], plan=None) -> list[LinkSample]:
    """What probes along ``plan`` (default: every pair) would measure with the directed links in ``slow``
    degraded."""
    pairs = [p for rnd in plan for p in rnd] if plan else list(itertools.combinations(nodes, 2))
    speed = lambda a, b: SLOW if (a, b) in slow else FAST  # noqa: E731
    return [LinkSample(a, b, speed(a, b), speed(b, a), 0.1, 1.0) for a, b in pairs]


def both_ways(node: str, nodes: list[str]) -> set[tuple[str, str]]:
    return {(node, o) for o in nodes if o != node} | {(o, node) for o in nodes if o != node}


@pytest.mark.parametrize("n", [2, 3, 4, 7, 16, 17, 64])
def test_each_round_is_a_matching_and_small_jobs_probe_every_pair(n):
    nodes = [f"n{i:02d}" for i in range(n)]
    plan = schedule(nodes)
    for pairs in plan:
        busy = [x for pair in pairs for x in pair]
        assert len(busy) == len(set(busy)), pairs  # one probe per node at a time
    probed = {frozenset(p) for pairs in plan for p in pairs}
    if n <= 16:
        assert probed == {frozenset(p) for p in itertools.combinations(nodes, 2)} and len(plan) == n - 1 + n % 2
    else:  # four random matchings: every node has four peers (one sits out a round when n is odd)
        assert len(plan) == 4 and all(sum(x in p for p in probed) >= 3 for x in nodes)  # at most one sat out
    assert schedule(nodes) == plan  # repeatable


@pytest.mark.parametrize("n", [3, 4, 8, 32])
@pytest.mark.parametrize("direction", ["both", "out", "in"])
def test_one_nodes_link_is_named_with_its_direction(n, direction):
    nodes = [f"n{i}" for i in range(n)]
    bad = nodes[-1]
    slow = both_ways(bad, nodes)
    if direction == "out":
        slow = {k for k in slow if k[0] == bad}
    if direction == "in":
        slow = {k for k in slow if k[1] == bad}
    report = judge(samples(nodes, slow, schedule(nodes)))
    assert [(f.kind, f.nodes, f.direction) for f in report.findings] == [("node", (bad,), direction)], report.summary()
    assert report.reference_mbps == FAST and not report.healthy
    assert f"node {bad}'s link is slow" in report.summary()


@pytest.mark.parametrize("n", [3, 5, 8])
def test_one_slow_pair_is_named_as_a_pair_not_as_a_node(n):
    nodes = [f"n{i}" for i in range(n)]
    report = judge(samples(nodes, {("n0", "n1")}))
    assert [(f.kind, f.nodes, f.direction) for f in report.findings] == [("pair", ("n0", "n1"), "a->b")]
    report = judge(samples(nodes, {("n0", "n1"), ("n1", "n0")}))
    assert [(f.kind, f.nodes, f.direction) for f in report.findings] == [("pair", ("n0", "n1"), "both")]
    assert "the link between n0 and n1 is slow (n0 <-> n1)" in report.summary()


@pytest.mark.parametrize("n", [2, 3, 6])
def test_healthy_links_with_noise_are_healthy(n):
    nodes = [f"n{i}" for i in range(n)]
    noisy = [LinkSample(s.src, s.dst, s.out_mbps * (0.6 + 0.1 * (i % 5)), s.in_mbps * (1.3 - 0.1 * (i % 4)), 0.1, 1)
             for i, s in enumerate(samples(nodes, set()))]
    report = judge(noisy)
    assert report.healthy and report.findings == [], report.summary()
    assert report.summary().startswith("no slow link among")


def test_two_nodes_cannot_tell_a_node_from_the_pair_and_every_link_slow_names_nothing():
    report = judge(samples(["a", "b"], {("a", "b")}))
    assert report.findings == [] and not report.healthy
    assert "with two nodes a node's link cannot be told from the pair's" in report.summary()
    nodes = ["a", "b", "c"]
    everything = set(itertools.permutations(nodes, 2))
    report = judge([LinkSample(a, b, SLOW, SLOW, 1, 1) for a, b in itertools.combinations(nodes, 2)])
    assert report.findings == [] and report.healthy  # uniformly slow: nothing is slower than the rest
    report = judge(samples(nodes, everything - {("a", "b")}))
    assert "every probed link is slow alike" not in report.summary()


def test_the_probe_server_measures_a_loopback_link_and_probes_a_peer_when_asked():
    a, b = ProbeServer("a", "127.0.0.1").start(), ProbeServer("b", "127.0.0.1").start()
    try:
        sample = measure_link("here", "b", "127.0.0.1", b.port, b.token, seconds=0.2)
        assert sample.out_mbps > 50 and sample.in_mbps > 50 and 0 < sample.rtt_ms < 500, sample
        asked = request_probe("127.0.0.1", a.port, a.token, peer="b", peer_addr="127.0.0.1", peer_port=b.port,
                              peer_token=b.token, seconds=0.2)
        assert (asked.src, asked.dst) == ("a", "b") and asked.out_mbps > 50
        records = {"a": {"address": "127.0.0.1", "linkprobe": a.record()},
                   "b": {"address": "127.0.0.1", "linkprobe": b.record()}, "old": {"address": "127.0.0.1"}}
        targets, missing = probe_targets(records)
        assert sorted(targets) == ["a", "b"] and missing == [
            "old runs no link probe (a single-node run, or a release before link checks)"]
        rounds = []
        report = check_links(records, seconds=0.1, progress=rounds.append)
        assert len(report.samples) == 1 and rounds and "not probed: old runs no link probe" in report.summary()
        json.dumps(report.to_json())
    finally:
        a.stop()
        b.stop()


def test_a_wrong_token_an_unknown_op_and_a_dead_peer_are_clear_errors():
    server = ProbeServer("a", "127.0.0.1").start()
    try:
        with pytest.raises(ProbeError, match="wrong or missing link-probe token"):
            measure_link("x", "a", "127.0.0.1", server.port, "not-the-token", seconds=0.1)
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(json.dumps({"op": "format-disk", "token": server.token}).encode() + b"\n")
            assert "unknown link-probe op 'format-disk'" in sock.makefile().readline()
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"\xff" * 5000)  # no line at all: dropped, the server lives on
            try:
                assert sock.recv(100) == b""
            except ConnectionResetError:  # closed with our bytes unread
                pass
        free = socket.socket()
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
        free.close()
        with pytest.raises(ProbeError, match=r"node a: cannot reach the link probe at 127.0.0.1:\d+"):
            request_probe("127.0.0.1", server.port, server.token, peer="gone", peer_addr="127.0.0.1",
                          peer_port=port, peer_token="t", seconds=0.1)
        assert measure_link("x", "a", "127.0.0.1", server.port, server.token, seconds=0.05).out_mbps > 0
    finally:
        server.stop()

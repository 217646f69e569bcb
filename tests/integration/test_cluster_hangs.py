"""One incident per hang across nodes (agent/etcd/cluster.py) against a real etcd: three nodes detect the
same hang at once; exactly one owns it and names the culprit another node saw."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from trainwarden.agent.etcd.cluster import HangCoordinator, ProgressPublisher, merge_verdicts, read_progress

pytestmark = pytest.mark.integration


@pytest.fixture
def client(etcd_client):
    return etcd_client


def test_three_nodes_detecting_one_hang_make_one_owner_who_names_the_remote_culprit(client):
    nodes = ("n0", "n1", "n2")
    peers = lambda me: (lambda job: [n for n in nodes if n != me])  # noqa: E731
    seen = {"n0": {"culprits": [], "summary": "no lagging rank: every rank is inside the same collective"},
            "n1": {"culprits": [], "summary": "no lagging rank: every rank is inside the same collective"},
            "n2": {"culprits": [4], "summary": "rank 4 never entered all_reduce #31 (group 0)"}}
    results = {}

    def detect(node, delay):
        time.sleep(delay)
        coordinator = HangCoordinator(client, node, peers=peers(node), verdict_wait_s=5.0)
        results[node] = coordinator.coordinate("mh", "14", f"id-{node}", {"verdict": seen[node]})

    threads = [threading.Thread(target=detect, args=(n, d)) for n, d in (("n0", 0), ("n1", 0.3), ("n2", 1.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    owners = [n for n, (owns, _) in results.items() if owns]
    assert len(owners) == 1, results
    owner = owners[0]
    verdicts = results[owner][1]
    assert set(verdicts) == set(nodes)  # it waited for the node that detected it a second later
    for node, (owns, answer) in results.items():
        if not owns:
            assert answer == {"node": owner, "incident": f"id-{owner}"}
    culprits, summary = merge_verdicts(verdicts)
    assert culprits == {4: "n2"} and summary.startswith("culprit rank 4 on n2")


def test_the_same_step_hanging_again_after_the_restart_is_a_new_incident(client):
    first = HangCoordinator(client, "n0", peers=lambda job: [], verdict_wait_s=0)
    assert first.coordinate("ma", "14", "a", {"verdict": {}})[0]
    assert not HangCoordinator(client, "n1", peers=lambda job: []).coordinate("ma", "14", "b", {"verdict": {}})[0]
    time.sleep(16)  # past HANG_KEY_TTL_S
    assert HangCoordinator(client, "n1", peers=lambda job: [], verdict_wait_s=0).coordinate(
        "ma", "14", "c", {"verdict": {}})[0]


def test_progress_summaries_are_published_under_a_lease(client):
    rank = SimpleNamespace(rank=3, last_step=41, connected=True)
    publisher = ProgressPublisher(client, "n1", lambda: [SimpleNamespace(job="mp", ranks=[rank])], ttl=5)
    publisher.publish_once()
    summary = read_progress(client, "mp")["n1"]
    assert summary["ranks"] == {"3": {"last_step": 41, "connected": True}} and summary["node"] == "n1"
    publisher.stop()  # revokes the lease: the summary goes
    assert read_progress(client, "mp") == {}

"""One incident per hang across nodes (agent/etcd/cluster.py) against a real etcd: three nodes detect the
same hang at once; exactly one owns it and names the culprit another node saw."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest

from trainwarden.agent.etcd.cluster import (HangCoordinator, ProgressPublisher, advance_round, agree_checkpoint_step,
                                           commit_in_round, merge_verdicts, read_progress, round_id)

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


def test_the_owner_hears_before_it_waits_for_a_node_that_never_answers_and_not_when_all_have(client):
    """The owner's workers used to be the last to stop: it waited up to `verdict_wait_s` for the verdict of a
    node cut off from the others before the watchdog aborted them. Now `on_wait` is called once the grace
    (`VERDICT_GRACE_S`) has passed without every live node's verdict, before the rest of the wait."""
    waited, returned = [], []
    HangCoordinator(client, "n1", peers=lambda job: []).coordinate("mw", "7", "b", {"verdict": {"summary": "b"}})
    owns, _ = HangCoordinator(client, "n0", peers=lambda job: ["n1", "n2"], verdict_wait_s=3.0).coordinate(
        "mw", "7", "a", {"verdict": {"summary": "a"}}, on_wait=lambda v: waited.append((time.monotonic(), v)))
    assert not owns and waited == []  # n1 owns step 7: a node that does not own a hang never waits
    coordinator = HangCoordinator(client, "n0", peers=lambda job: ["n1", "n2"], verdict_wait_s=3.0)
    owns, verdicts = coordinator.coordinate(
        "mw", "8", "c", {"verdict": {"summary": "c"}}, on_wait=lambda v: waited.append((time.monotonic(), v)))
    returned.append(time.monotonic())
    assert owns and set(verdicts) == {"n0"}  # n1 and n2 (cut off) never answered
    assert coordinator.unanswered == ["n1", "n2"]  # what the hang incident names
    (told_at, so_far), = waited  # told once, with what was in, and before the wait was over
    assert set(so_far) == {"n0"} and told_at < returned[0]
    # a node that judged the hang a moment later than the owner is in within the grace: no early abort
    late = threading.Timer(0.3, lambda: HangCoordinator(client, "n1", peers=lambda job: []).coordinate(
        "mw", "9", "e", {"verdict": {"summary": "e"}}))
    late.start()
    coordinator = HangCoordinator(client, "n0", peers=lambda job: ["n1"], verdict_wait_s=3.0)
    owns, verdicts = coordinator.coordinate(
        "mw", "9", "d", {"verdict": {"summary": "d"}}, on_wait=lambda v: waited.append((time.monotonic(), v)))
    late.join(10)
    assert owns and set(verdicts) == {"n0", "n1"} and len(waited) == 1
    assert coordinator.unanswered == []


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


def test_nodes_proposing_a_step_to_checkpoint_before_growing_agree_on_the_first_one(client):
    """Every node's launcher proposes its own step when nodes wait to join; all of them must save after the
    same one (the save is collective). A later round agrees afresh."""
    results, barrier = {}, threading.Barrier(3)

    def propose(node, step):
        barrier.wait()
        results[node] = agree_checkpoint_step(client, "mg", "4", step, node)

    threads = [threading.Thread(target=propose, args=(n, s)) for n, s in (("n0", 30), ("n1", 31), ("n2", 29))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(set(results.values())) == 1, results
    step, proposer = results["n0"]
    assert step == {"n0": 30, "n1": 31, "n2": 29}[proposer]
    assert agree_checkpoint_step(client, "mg", "5", 77, "n1") == (77, "n1")
    client.put("/trainwarden/v1/jobs/mg/grow/6", "not json")
    with pytest.raises(ValueError, match="grow/6 holds no step"):
        agree_checkpoint_step(client, "mg", "6", 80, "n2")


def test_only_a_worker_of_the_jobs_current_round_publishes_a_checkpoint(client):
    """DESIGN's fenced rounds, in one etcd transaction: a node left in an older round is refused."""
    pointer = lambda step: {"step": step, "path": f"/ckpt/step-{step}", "time": 1.0, "bytes": 10}  # noqa: E731
    key = "/trainwarden/v1/jobs/mf/checkpoint"
    assert commit_in_round(client, "mf", round_id(0, 1), pointer(5)) is None  # the first round records itself
    assert json.loads(client.get(key)[0])["step"] == 5
    assert advance_round(client, "mf", round_id(0, 2)) is None  # the nodes of round 2 started
    refusal = commit_in_round(client, "mf", round_id(0, 1), pointer(10))  # a fenced node of round 1
    assert refusal and "round 2 of generation 0" in refusal and "left behind" in refusal
    assert json.loads(client.get(key)[0])["step"] == 5
    assert commit_in_round(client, "mf", round_id(0, 2), pointer(10)) is None
    assert commit_in_round(client, "mf", round_id(0, 3), pointer(15)) is None  # a commit advances the round too
    assert advance_round(client, "mf", round_id(0, 2)) is not None
    # a new generation starts its rendezvous at round 0 again, and is still newer
    assert commit_in_round(client, "mf", round_id(1, 0), pointer(20)) is None
    assert commit_in_round(client, "mf", round_id(0, 9), pointer(25)) is not None
    assert json.loads(client.get(key)[0])["step"] == 20


def test_a_node_busy_beacon_is_seen_by_the_others_and_goes_when_it_stops_or_its_agent_dies(client):
    """set_busy puts jobs/<job>/busy/<node> once, keeps its lease alive, and deletes it when the work ends; a beacon
    whose node went silent ends with its lease (BUSY_TTL_S)."""
    from trainwarden.agent.etcd import cluster as cluster_mod

    a, b = HangCoordinator(client, "na"), HangCoordinator(client, "nb")
    assert a.busy_elsewhere("bz") == [] and b.busy_elsewhere("bz") == []
    for _ in range(3):
        a.set_busy("bz", True)  # one put: the next calls change nothing
    assert b.busy_elsewhere("bz") == ["na"] and a.busy_elsewhere("bz") == []
    revision = client.get(cluster_mod.job_key("bz", "busy", "na"))[1].mod_revision
    a.set_busy("bz", True)
    assert client.get(cluster_mod.job_key("bz", "busy", "na"))[1].mod_revision == revision
    a.set_busy("bz", False)
    assert b.busy_elsewhere("bz") == []
    b.set_busy("bz", True)
    lease = b._beacon_lease
    assert a.busy_elsewhere("bz") == ["nb"]
    lease.revoke()  # as when nb's agent dies and its lease ends
    assert a.busy_elsewhere("bz") == []


def test_a_node_slow_off_the_links_is_seen_by_the_others_apart_from_its_busy_beacon(client):
    """set_slow_off_links is the same beacon under jobs/<job>/slow_off_links/<node> (agent/watchdog/comm_watch.py):
    put once, seen by the other nodes only, deleted when it ends; a node's busy and slow beacons share one lease
    and end apart."""
    from trainwarden.agent.etcd import cluster as cluster_mod

    a, b = HangCoordinator(client, "na"), HangCoordinator(client, "nb")
    assert b.slow_off_links_elsewhere("sl") == []
    a.set_slow_off_links("sl", True)
    a.set_busy("sl", True)
    revision = client.get(cluster_mod.job_key("sl", "slow_off_links", "na"))[1].mod_revision
    a.set_slow_off_links("sl", True)  # no change: no write
    assert client.get(cluster_mod.job_key("sl", "slow_off_links", "na"))[1].mod_revision == revision
    assert b.slow_off_links_elsewhere("sl") == ["na"] and a.slow_off_links_elsewhere("sl") == []
    assert b.busy_elsewhere("sl") == ["na"]
    a.set_slow_off_links("sl", False)
    assert b.slow_off_links_elsewhere("sl") == [] and b.busy_elsewhere("sl") == ["na"]
    a.set_busy("sl", False)
    assert b.busy_elsewhere("sl") == []

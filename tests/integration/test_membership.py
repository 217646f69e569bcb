"""A node's membership in a job (agent/etcd/membership.py) against a real etcd: who starts a generation, who
joins it, who is refused, and that a dead node's record goes by itself."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psutil
import pytest

from trainwarden.agent.etcd.membership import NodeMembership, NodeTaken, admit, live_nodes

pytestmark = pytest.mark.integration


@pytest.fixture
def client(etcd_client):
    return etcd_client


def _me() -> dict:
    return {"host": "h", "pid": os.getpid(), "started": psutil.Process().create_time()}


def _join(client, job, node, owner, *, ttl=10):
    admission, release = admit(client, job, node, host="h")
    try:
        member = NodeMembership(client, job, node, {"owner": owner}, ttl=ttl)
        member.start()
    finally:
        release()
    return admission, member


def test_the_first_node_starts_the_job_the_others_join_it_and_a_second_run_of_a_node_is_refused(client):
    first, a = _join(client, "mn", "a", _me())
    second, b = _join(client, "mn", "b", _me())
    try:
        assert first.starts_job and not first.peers
        assert not second.starts_job and set(second.peers) == {"a"}
        assert set(live_nodes(client, "mn")) == {"a", "b"}
        with pytest.raises(NodeTaken, match="node a already runs job mn"):
            admit(client, "mn", "a", host="h")
        # the refusal released the claim lock: another node still gets in
        third, c = _join(client, "mn", "c", _me())
        c.stop()
        assert set(third.peers) == {"a", "b"}
    finally:
        a.stop()
        b.stop()
    assert live_nodes(client, "mn") == {}  # stop revokes the lease: the records go at once


def test_a_record_left_by_a_killed_run_on_this_host_is_replaced_at_once(client):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ghost = {"host": "h", "pid": dead.pid, "started": 1.0}
    _, left = _join(client, "mk", "a", ghost, ttl=30)
    left._stopping = True  # the killed run's keep-alive died with it; its lease has not expired yet
    admission, release = admit(client, "mk", "a", host="h")
    release()
    assert admission.starts_job and admission.replaced["owner"] == ghost


def test_a_node_that_stops_renewing_its_lease_leaves_the_job_by_itself(client):
    _, member = _join(client, "ml", "a", _me(), ttl=2)
    with member._cond:  # the keep-alive thread dies as with its process
        member._stopping = True
        member._cond.notify()
    member._thread.join(5)
    deadline = time.monotonic() + 10
    while live_nodes(client, "ml") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_nodes(client, "ml") == {}


def test_updates_reach_etcd_without_the_caller_waiting(client):
    _, member = _join(client, "mu", "a", _me())
    try:
        member.update(phase="running")
        deadline = time.monotonic() + 5
        while live_nodes(client, "mu")["a"].get("phase") != "running" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live_nodes(client, "mu")["a"]["phase"] == "running"
    finally:
        member.stop()


def test_two_nodes_starting_at_once_elect_exactly_one_starter(client):
    results, members = [], []
    lock = threading.Lock()

    def enter(node):
        admission, m = _join(client, "mr", node, _me())
        with lock:
            results.append(admission.starts_job)
            members.append(m)

    threads = [threading.Thread(target=enter, args=(n,)) for n in ("a", "b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for m in members:
        m.stop()
    assert sorted(results) == [False, False, True]


def test_the_claim_lock_stays_under_the_trainwarden_prefix(client, etcd_server):
    """A user granted only /trainwarden/ may run jobs: nothing is written elsewhere (python-etcd3's own lock
    writes under /locks/)."""
    _, member = _join(client, "mp", "a", _me())
    member.stop()
    keys = [m.key.decode() for _, m in client.get_all()]
    assert all(k.startswith("/trainwarden/v1/") for k in keys), keys

"""node_lost against a real etcd: a member whose lease ends is named once, by one of the survivors; a member
that leaves on purpose is no loss."""

from __future__ import annotations

import json
import os
import time

import psutil
import pytest

from trainwarden.agent.etcd.membership import NodeMembership, live_nodes, nodes_prefix
from trainwarden.agent.incidents import IncidentKind
from trainwarden.agent.incidents.node_loss import NodeLossWatcher

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _member(client, job, node, **fields):
    member = NodeMembership(client, job, node, {"owner": {"host": "h", "pid": os.getpid(),
                                                          "started": psutil.Process().create_time()}, **fields})
    member.start()
    return member


def _watchers(client, job, *nodes):
    recorded = []
    return recorded, [NodeLossWatcher(client, job, n, lambda inc: recorded.append(inc) or inc) for n in nodes]


def test_a_member_whose_lease_expires_is_one_node_lost_incident_naming_it(etcd_client):
    a, c = _member(etcd_client, "lj", "a", ranks=[0, 1]), _member(etcd_client, "lj", "c", ranks=[4, 5])
    lease = etcd_client.lease(2)  # node b keeps nothing alive: it was killed right after it wrote its record
    etcd_client.put(nodes_prefix("lj") + "b", json.dumps({"ranks": [2, 3], "round": 4}), lease=lease)
    try:
        recorded, watchers = _watchers(etcd_client, "lj", "a", "c")
        for w in watchers:
            assert w.check_once() == []
        while "b" in live_nodes(etcd_client, "lj"):  # etcd ends the lease (the test's timeout bounds it)
            time.sleep(0.2)
        for w in watchers:
            w.check_once()
            w.check_once()
        [incident] = recorded
        assert incident.kind == IncidentKind.NODE_LOST and incident.node == "b" and incident.ranks == (2, 3)
        assert incident.evidence["round"] == 4 and incident.evidence["recorded_by"] in ("a", "c")
        assert incident.evidence["lease_ended_after"] <= incident.evidence["lease_ended_by"]
        assert incident.evidence["summary"].startswith("node b (ranks 2,3) stopped renewing its membership")
    finally:
        a.stop()
        c.stop()


def test_a_member_that_stops_on_purpose_is_no_loss(etcd_client):
    a, b = _member(etcd_client, "lk", "a"), _member(etcd_client, "lk", "b")
    try:
        recorded, [watcher] = _watchers(etcd_client, "lk", "a")
        watcher.check_once()
        b.stop()
        assert "b" not in live_nodes(etcd_client, "lk")
        watcher.check_once()
        assert recorded == []
    finally:
        a.stop()


def test_a_member_replaced_by_a_new_run_before_its_lease_ended_is_a_loss(etcd_client):
    a = _member(etcd_client, "lr", "a")
    lease = etcd_client.lease(30)
    key = nodes_prefix("lr") + "b"
    etcd_client.put(key, json.dumps({"owner": {"pid": 1}, "ranks": [2, 3]}), lease=lease)
    try:
        recorded, [watcher] = _watchers(etcd_client, "lr", "a")
        watcher.check_once()
        etcd_client.put(key, json.dumps({"owner": {"pid": 2}}), lease=lease)  # b restarted: its old run was gone
        watcher.check_once()
        assert [(i.node, i.ranks) for i in recorded] == [("b", (2, 3))]
    finally:
        a.stop()
        lease.revoke()


def test_the_running_watcher_learns_of_a_loss_from_its_watch_without_reading_the_members_again(etcd_client):
    """The watcher's clock never moves, so its safety re-read never falls due and its timer only checks the watch:
    the loss can reach it only as the watch's delete event."""
    a = _member(etcd_client, "lw", "a")
    lease = etcd_client.lease(60)
    etcd_client.put(nodes_prefix("lw") + "b", json.dumps({"ranks": [1]}), lease=lease)
    recorded = []
    watcher = NodeLossWatcher(etcd_client, "lw", "a", lambda inc: recorded.append(inc) or inc, period_s=0.05,
                              clock=lambda: 1000.0)
    reads = []
    real = watcher.check_once
    watcher.check_once = lambda: reads.append(1) or real()
    watcher.start()
    try:
        while not reads or "b" not in watcher._seen:  # the first read (the test's timeout bounds the waits)
            time.sleep(0.05)
        lease.revoke()  # b's power goes
        while not recorded:
            time.sleep(0.05)
        assert [i.node for i in recorded] == ["b"] and reads == [1]
    finally:
        watcher.stop()
        a.stop()

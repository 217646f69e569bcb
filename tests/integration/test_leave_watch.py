"""A launcher learns of the job's leave requests and of its node's exclusion through two watches (issue 28), and
reads them again when a watch is lost: a real etcd, a ``LeaveWatch`` whose clock never moves."""

from __future__ import annotations

import json
import time

import pytest

from trainwarden.agent.etcd.client import open_client
from trainwarden.agent.etcd.cluster import LeaveWatch, request_leave
from trainwarden.agent.etcd.keys import job_key

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _until(predicate) -> None:
    while not predicate():  # the test's timeout bounds it
        time.sleep(0.05)


def test_leave_requests_and_the_exclusion_arrive_by_watch_and_after_a_lost_watch_by_a_read(etcd_server):
    client = open_client("127.0.0.1", etcd_server.client_port, timeout=5.0)
    leaves = LeaveWatch(client, "lv", "n1", clock=lambda: 1000.0)
    try:
        leaves.refresh()
        assert leaves.request("00000001.00000002") is None and not leaves.excluded()
        request_leave(client, "lv", "00000001.00000002", "n0", 40)
        client.put(job_key("lv", "exclude", "n1"), json.dumps({"why": "straggler"}))
        _until(lambda: leaves.request("00000001.00000002") == {"node": "n0", "step": 40} and leaves.excluded())
        client.delete(job_key("lv", "exclude", "n1"))
        _until(lambda: not leaves.excluded())

        etcd_server.stop()  # the watch stream breaks without a word to the callbacks
        _until(lambda: not all(w.alive() for w in leaves._watches))
        etcd_server.start()
        client.put(job_key("lv", "exclude", "n1"), json.dumps({"why": "again"}))
        _until(lambda: _refreshed(leaves))
        assert leaves.excluded()
    finally:
        leaves.stop()
        client.close()


def _refreshed(leaves: LeaveWatch) -> bool:
    try:
        leaves.refresh()
    except Exception:  # etcd still starting
        return False
    return leaves.excluded()

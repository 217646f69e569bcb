"""One link check per job at a time (agent/linkcheck/coordinate.py), against a real etcd: nodes that ask at
once run one check between them and all get its report; a recent report is reused; a check that fails is an
``error`` report, never an exception on the watchdog's side."""

from __future__ import annotations

import threading
import time

import pytest

from trainwarden.agent.linkcheck.coordinate import JobLinkCheck

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


class _Report:
    def __init__(self, summary: str) -> None:
        self.summary = summary

    def to_json(self) -> dict:
        return {"summary": self.summary}


def test_nodes_asking_at_once_share_one_check_and_a_recent_report_is_reused(etcd_client):
    calls = []

    def check(records, *, seconds):
        calls.append(sorted(records))
        time.sleep(1.0)  # long enough for every node to ask while it runs
        return _Report("node n2's link is slow both ways")

    etcd_client.put("/trainwarden/v1/jobs/j/nodes/n0", '{"address": "10.0.0.1"}')
    etcd_client.put("/trainwarden/v1/jobs/j/nodes/n1", '{"address": "10.0.0.2"}')
    checkers = [JobLinkCheck(etcd_client, "j", f"n{i}", check=check) for i in range(3)]
    results, done = [], threading.Event()

    def on_done(report):
        results.append(report)
        if len(results) == 3:
            done.set()

    for c in checkers:
        assert c.start(on_done)
    assert done.wait(30), results
    assert len(calls) == 1 and calls[0] == ["n0", "n1"]
    assert {r["summary"] for r in results} == {"node n2's link is slow both ways"}
    assert len({r["by"] for r in results}) == 1 and len({r["at"] for r in results}) == 1
    assert etcd_client.get("/trainwarden/v1/jobs/j/linkcheck/lock")[0] is None  # released

    again = threading.Event()
    assert checkers[2].start(lambda r: (results.append(r), again.set()))
    assert again.wait(30) and len(calls) == 1 and results[-1] == results[0]  # reused, not redone


def test_a_check_that_fails_is_an_error_report(etcd_client):
    def check(records, *, seconds):
        raise OSError("probe server gone")

    got = []
    finished = threading.Event()
    checker = JobLinkCheck(etcd_client, "k", "n0", check=check)
    assert checker.start(lambda r: (got.append(r), finished.set()))
    assert finished.wait(30)
    assert got[0]["error"].startswith("link check failed:") and "probe server gone" in got[0]["error"], got

"""``--link-policy exclude`` in ``trainwarden run`` (agent/launch/links.py ``LinkChecks``), with fakes for the
leave protocol and the cordon in etcd: which link check reports make this node leave the job, and what it says."""

from __future__ import annotations

import io
from contextlib import ExitStack

from trainwarden.agent.launch.links import LinkChecks

JOB, NODE = "j", "n1"


class _Control:
    """JobControl as the policy uses it: the cordon (agent/etcd/jobs.py)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.cordoned: list[tuple] = []
        self.error = error

    def cordon(self, node: str, reason: str, *, by: str | None = None) -> None:
        if self.error is not None:
            raise self.error
        self.cordoned.append((node, reason, by))


class _Run:
    def __init__(self, policy: str = "exclude", *, leaving: bool = False, control: _Control | None = None) -> None:
        self.control, self.out, self.left = control or _Control(), io.StringIO(), []
        self.links = LinkChecks(job=JOB, node=NODE, policy=policy, out=self.out, leaving=lambda: leaving,
                                leave=self.left.append, control=lambda client: self.control)


def _report(*findings: dict, summary: str = "n1's link is slow") -> dict:
    return {"findings": list(findings), "summary": summary}


SLOW_HERE = {"kind": "node", "nodes": [NODE]}


def test_a_report_naming_this_node_cordons_it_and_makes_it_leave_with_the_reports_words():
    run = _Run()
    run.links.on_report(_report(SLOW_HERE))
    assert run.left == ["link check: n1's link is slow"]
    assert run.control.cordoned == [(NODE, "link check: n1's link is slow",
                                     "trainwarden run on n1 (--link-policy exclude)")]
    assert "node n1 leaves job j (--link-policy exclude)" in run.out.getvalue()


def test_without_the_exclude_policy_a_report_changes_nothing():
    run = _Run(policy="report")
    run.links.on_report(_report(SLOW_HERE))
    assert run.left == [] and run.control.cordoned == []


def test_a_report_naming_another_node_or_a_pair_changes_nothing_here():
    run = _Run()
    run.links.on_report(_report({"kind": "node", "nodes": ["n2"]}, {"kind": "pair", "nodes": [NODE, "n2"]},
                                {"kind": "node", "nodes": [NODE, "n2"]}))
    run.links.on_report({"error": "link check failed: etcd away"})
    assert run.left == [] and run.control.cordoned == []


def test_a_node_already_leaving_is_not_asked_again():
    run = _Run(leaving=True)
    run.links.on_report(_report(SLOW_HERE))
    assert run.left == [] and run.control.cordoned == []


def test_a_cordon_etcd_refuses_still_leaves_the_job():
    run = _Run(control=_Control(error=TimeoutError("etcd")))
    run.links.on_report(_report(SLOW_HERE, summary="x" * 600))
    assert run.left == [("link check: " + "x" * 600)[:500]]


def test_no_probe_is_served_without_an_address():
    run, record = _Run(), {}
    with ExitStack() as cleanup:
        run.links.serve_probe(record, cleanup, None)
    assert record == {}


def test_a_regression_asks_for_a_link_check_through_the_watchdog():
    run = _Run()

    class _Watchdog:
        link_check = None

    watchdog = _Watchdog()
    run.links.ask_on_regression(watchdog, client=object())
    assert callable(watchdog.link_check)

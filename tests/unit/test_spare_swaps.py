"""Hot spares in the metrics and the goodput ledger (issue 47, item 5): the spares waiting and the swaps by cause
(agent/launch/spare_swaps.py), a swap round known on every node of it (native_handler.spare_swap), and its recovery
charged to ``spare_swap`` (agent/launch/goodput.py)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trainwarden.agent.etcd.keys import job_key
from trainwarden.agent.incidents.record import Incident, IncidentKind, IncidentState
from trainwarden.agent.incidents.spare_takeover import SpareTakeover, took_left
from trainwarden.agent.launch.goodput import CAUSE_LABELS, CAUSES, GoodputLedger
from trainwarden.agent.launch.spare_swaps import SWAP_CAUSES, SpareSwaps
from trainwarden.agent.rendezvous.native import Round
from trainwarden.agent.rendezvous.native_handler import spare_swap


def _samples(collector) -> dict:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}, text


def test_the_spare_gauge_follows_the_node_and_every_swap_cause_is_exported_from_zero():
    swaps = SpareSwaps("gpt", node="n3")
    samples, _ = _samples(swaps)
    node = (("job", "gpt"), ("node", "n3"))
    assert samples[("trainwarden_job_spare_nodes", node)] == 0
    assert {cause: samples[("trainwarden_spare_swaps_total", (("cause", cause), *node))]
            for cause in SWAP_CAUSES} == {"node_lost": 0, "excluded": 0, "drained": 0}
    swaps.waiting(True)  # the round closed without it
    assert _samples(swaps)[0][("trainwarden_job_spare_nodes", node)] == 1
    swaps.waiting(False)  # it took a lost node's ranks ...
    swaps.swapped("node_lost")  # ... and named itself in the loss
    samples, _ = _samples(swaps)
    assert samples[("trainwarden_job_spare_nodes", node)] == 0
    assert samples[("trainwarden_spare_swaps_total", (("cause", "node_lost"), *node))] == 1
    with pytest.raises(ValueError, match="swap cause 'slow': expected one of node_lost, excluded, drained"):
        swaps.swapped("slow")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_accepts_the_spare_metrics():
    swaps = SpareSwaps("gpt", node="n3")
    swaps.swapped("node_lost")
    _, text = _samples(swaps)
    out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr


def _round(number, *members) -> Round:
    return Round(number, members[0], tuple(members), members[0], "test", 1)


def test_a_swap_round_is_one_where_a_newcomer_holds_a_position_of_the_round_before():
    before = _round(3, "a", "b", "c")
    assert spare_swap(before, _round(4, "a", "s", "c"))  # s took b's place
    assert not spare_swap(before, _round(4, "a", "b", "c"))  # a restart of the same nodes
    assert not spare_swap(before, _round(4, "a", "c"))  # a shrink: positions closed up
    assert not spare_swap(before, _round(4, "a", "b", "c", "x"))  # growth: the newcomer goes after them
    assert not spare_swap(None, _round(0, "a", "b"))  # a first round replaced nobody


def test_a_swap_rounds_recovery_is_charged_to_spare_swap_not_restart():
    ledger = GoodputLedger("j", launched_at=0.0)
    ledger.round_started()
    t = 5.0
    for index in range(1, 11):
        t += 1.0
        ledger.step(index, t, 1.0)
    ledger.failed(t + 0.5)  # the survivors' round failed when the node went
    ledger.round_started(t + 3.0, spare_swap=True)  # the spare took its place
    ledger.restored(1.5)
    ledger.step(11, t + 8.0, 1.0)  # first step of the swap round starts 6.5 s after the failure
    g = ledger.snapshot()
    assert g.badput_s["spare_swap"] == pytest.approx(5.0) and g.badput_s["restore"] == pytest.approx(1.5)
    assert g.badput_s["restart"] == 0 and g.badput_s["detection"] == pytest.approx(0.5)
    assert "spare swap 5.0s" in g.describe() and "spare_swap" in CAUSES and CAUSE_LABELS["spare_swap"]
    ledger.round_started(t + 20.0)  # the next round is an ordinary one again
    ledger.step(12, t + 22.0, 1.0)
    assert ledger.snapshot().badput_s["rendezvous"] == pytest.approx(13.0)
    assert ledger.snapshot().badput_s["spare_swap"] == pytest.approx(5.0)
    resumed = GoodputLedger("j", launched_at=0.0)
    resumed.resume(json.loads(json.dumps(ledger.state())), now=t + 22.0)  # persisted across launchers
    assert resumed.snapshot().badput_s["spare_swap"] == pytest.approx(5.0)


class _Etcd:
    def __init__(self):
        self.values: dict[str, bytes] = {}

    def get(self, key):
        return self.values.get(key), None

    def get_prefix(self, prefix):
        return [(v, None) for k, v in sorted(self.values.items()) if k.startswith(prefix)]


def test_the_spare_counts_its_swap_once_it_named_itself_in_the_loss():
    etcd, swaps = _Etcd(), []
    lost = Incident(id="i-n1", kind=IncidentKind.NODE_LOST, job="j", node="n1", ranks=(2, 3),
                    evidence={"round": 4, "summary": "node n1 stopped renewing"}, detected_at=1.0,
                    state=IncidentState.RESOLVED)
    etcd.values[job_key("j", "incidents", lost.id)] = json.dumps(lost.to_json()).encode()
    takeover = SpareTakeover(etcd, "j", "n3", lambda i: i, wait_s=5.0, poll_s=0.01, on_swap=lambda *swap: swaps.append(swap))
    named = takeover._name_spare(5, (2, 3))
    assert swaps == [("node_lost", named)] and named.evidence["spare"] == "n3"
    nothing = SpareTakeover(_Etcd(), "j", "n3", lambda i: i, wait_s=0.05, poll_s=0.01, on_swap=lambda *swap: swaps.append(swap))
    assert nothing._name_spare(5, (2, 3)) is None and len(swaps) == 1  # no loss found: no swap counted


def test_a_spare_that_took_an_excluded_nodes_ranks_names_it_and_counts_the_swap_as_excluded():
    """Issue 47 item 3: the excluder writes why it leaves into the round's leave record; the spare whose first round
    follows it, with its ranks, records a spare_swap incident and counts cause="excluded" (it counted nothing)."""
    etcd, swaps = _Etcd(), []
    etcd.values[job_key("j", "leave", "4")] = json.dumps({
        "node": "n1", "step": 40, "cause": "excluded", "ranks": [2, 3],
        "reason": "link check: n1's link is 3.1x slower"}).encode()
    recorded = []
    takeover = SpareTakeover(etcd, "j", "n3", lambda i: recorded.append(i) or i, wait_s=1.0, poll_s=0.01,
                             on_swap=lambda *swap: swaps.append(swap))
    named = takeover._name_spare(5, (2, 3))
    assert swaps == [("excluded", named)] and recorded == [named]
    assert named.kind == IncidentKind.SPARE_SWAP and named.node == "n1" and named.ranks == (2, 3)
    assert named.evidence["summary"] == ("node n1 excluded (link check: n1's link is 3.1x slower); spare n3 took "
                                         "ranks 2,3 after step 40")
    assert takeover._name_spare(6, (2, 3)) is None  # another round's leave: not this swap
    assert took_left({"node": "n3", "step": 1, "cause": "excluded", "ranks": (2, 3)}, node="n3", ranks=(2, 3)) \
        is None  # its own leave (the ranks came back to it): no swap


def test_a_spare_that_took_a_drained_nodes_ranks_names_it_and_counts_the_swap_as_drained():
    """Issue 47: a node drained (SIGUSR1: the leave record's cause ``drain``) and replaced by the spare is a swap too,
    counted as cause="drained" with a spare_swap incident that says so; before, the spare counted and recorded
    nothing (only an exclusion was taken for a swap)."""
    etcd, swaps, recorded = _Etcd(), [], []
    etcd.values[job_key("j", "leave", "4")] = json.dumps({
        "node": "n1", "step": 33, "cause": "drain", "ranks": [2, 3], "reason": ""}).encode()
    takeover = SpareTakeover(etcd, "j", "n3", lambda i: recorded.append(i) or i, wait_s=1.0, poll_s=0.01,
                             on_swap=lambda *swap: swaps.append(swap))
    named = takeover._name_spare(5, (2, 3))
    assert named is not None, "the spare took a drained node's ranks and recorded nothing"
    assert swaps == [("drained", named)] and recorded == [named]
    assert named.kind == IncidentKind.SPARE_SWAP and named.node == "n1" and named.ranks == (2, 3)
    assert named.evidence["cause"] == "drained" and named.evidence["step"] == 33
    assert named.evidence["summary"] == "node n1 drained; spare n3 took ranks 2,3 after step 33"
    assert named.action == "node n1 left after the checkpoint of step 33"
    counted = SpareSwaps("j", node="n3")
    counted.swapped(swaps[0][0])
    assert _samples(counted)[0][("trainwarden_spare_swaps_total", (("cause", "drained"), ("job", "j"),
                                                                   ("node", "n3")))] == 1

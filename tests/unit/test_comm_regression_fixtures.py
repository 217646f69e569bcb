"""The recorded input of the communication-regression detector (tests/fixtures/comm_regression/README.md) holds
what the detector will be designed on: every check has each rank's cumulative counters, the traces cover the
fault's window on the same clock, and the faults slowed the job where the README says (the ground truth a
detector's test will lean on)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainwarden.agent.watchdog.straggler_trace import read_trace

pytestmark = pytest.mark.timeout(60)

TRACES = Path(__file__).resolve().parents[1] / "fixtures" / "comm_regression"
NODES = {"n0": ["0", "1"], "n1": ["2", "3"], "n2": ["4", "5"]}
SCENARIOS = ["ddp_link", "ddp_pair", "ddp_healthy", "ddp_straggler", "gpt_link"]


def _record(name: str) -> dict:
    return json.loads((TRACES / f"{name}.record.json").read_text())


def _step_s(updates: list[dict], rank: str, start: float, end: float) -> float:
    """Seconds per step of ``rank`` between the checks nearest ``start`` and ``end`` (from ``totals``)."""
    rows = [u for u in updates if rank in u.get("totals", {})]
    a = min(rows, key=lambda u: abs(u["t"] - start))
    b = min(rows, key=lambda u: abs(u["t"] - end))
    return (b["t"] - a["t"]) / (b["totals"][rank][0] - a["totals"][rank][0])


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_check_holds_the_ranks_counters_over_the_whole_window(name):
    rec = _record(name)
    for node, ranks in NODES.items():
        updates = list(read_trace(TRACES / f"{name}_{node}.jsonl.gz"))
        # only the check after the last rank left has no counters
        assert all("totals" in u for u in updates[:-1]), node
        assert sorted({r for u in updates for r in u.get("totals", {})}) == ranks
        assert all(len(v) == 6 for u in updates for v in u.get("totals", {}).values())
        times = [u["t"] for u in updates]
        assert times[0] < rec["first_step_t"] and rec["fault_end_t"] + 20 < times[-1] < rec["end_t"], node
        assert max(b - a for a, b in zip(times, times[1:])) < 2.0, node


@pytest.mark.parametrize("name, slower", [("ddp_link", 4.0), ("ddp_pair", 2.5), ("gpt_link", 2.5),
                                          ("ddp_healthy", None), ("ddp_straggler", None)])
def test_the_fault_slowed_every_rank_while_it_lasted_and_only_then(name, slower):
    rec = _record(name)
    first, start, end = rec["first_step_t"], rec["fault_start_t"], rec["fault_end_t"]
    for node, ranks in NODES.items():
        updates = list(read_trace(TRACES / f"{name}_{node}.jsonl.gz"))
        for rank in ranks:
            before = _step_s(updates, rank, first + 5, start)
            during = _step_s(updates, rank, start + 3, end)
            after = _step_s(updates, rank, end + 3, updates[-1]["t"] - 3)
            if slower:
                assert during > slower * before and during > slower * after, (node, rank, before, during, after)
            else:
                assert 0.8 < during / before < 1.25 and 0.8 < after / before < 1.25, (node, rank, before, during)

"""The 3 AM story on the multi-host test bed (issue 25): a real three-node job trains healthy for a minute,
then one node's link drops to 256 kbit/s both ways. The watchdog sees a communication regression (steps slower
because every rank waits longer in collectives, compute flat), asks for one link check for the job, and the
incident it recorded names the node: no rank's own numbers could have (a collective is as slow as its slowest
link for everyone in it). Nothing is flagged before the fault.

Prints the detection and localization times after the fault (BENCHMARKS.md, "Slow link"). Not in the default
suite (about 2 minutes; its end-to-end twin there is tests/e2e/test_slow_link_exclude.py, the reference job
with --link-policy exclude): run it with `python -m pytest -s tests/bench/slow_link_story.py` (root)."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

from procs import wait_for
from testbed import TestBed
from trainwarden.agent.incidents import list_incidents

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(480)]

if TestBed.unavailable():
    pytest.skip(TestBed.unavailable(), allow_module_level=True)

DDP = Path(__file__).parents[1] / "fixtures" / "unchanged" / "ddp_tutorial.py"
NODES = ("n0", "n1", "n2")
STEP = re.compile(r"^\[(\d{4})\] loss=", re.M)


def test_a_degraded_link_is_a_comm_regression_whose_incident_names_the_node(tmp_path):
    with TestBed(nodes=3, etcd_members=1, workdir=tmp_path / "bed") as bed:
        for node in NODES:
            env = dict(os.environ, TRAINWARDEN_STATE_HOME=str(tmp_path / node), OMP_NUM_THREADS="1")
            bed.spawn(node, [sys.executable, "-m", "trainwarden.agent.cli", "run", "--metrics-port", "0",
                             "--nnodes", "3", "--nproc-per-node", "2", "--node", node, "--job", "story",
                             "--max-restarts", "0", "--etcd", bed.etcd_endpoints, "--",
                             str(DDP), "--steps", "100000", "--sleep", "0.05"],
                      log=tmp_path / f"{node}.log", env=env)
        log0 = tmp_path / "n0.log"

        def steps() -> int:
            found = STEP.findall(log0.read_text(errors="replace")) if log0.exists() else []
            return int(found[-1]) if found else -1

        def incidents() -> list:
            return [i for node in NODES for i in list_incidents(tmp_path / node, "story")
                    if i.kind.value == "comm_regression"]

        wait_for(lambda: steps() >= 0, 240, what="the first step")
        time.sleep(75)  # warm-up and six healthy windows of at least 5 s: the baseline, with room
        assert incidents() == [], "a communication regression before any fault"
        healthy_steps = steps()
        fault = time.monotonic()
        bed.degrade("n2", "256kbit")

        wait_for(lambda: incidents(), 120, what="a comm_regression incident")
        detected = time.monotonic() - fault
        wait_for(lambda: any("link_check" in i.evidence for i in incidents()), 180, what="the link check's report")
        located = time.monotonic() - fault
        reports = [i.evidence["link_check"] for i in incidents() if "link_check" in i.evidence]
        print(f"\nslow link: comm_regression {detected:.1f} s after the fault, node named {located:.1f} s after it; "
              f"{healthy_steps} steps before the fault; report: {reports[0].get('summary') or reports[0]}")
        findings = reports[0].get("findings")
        assert findings and findings[0]["kind"] == "node" and findings[0]["nodes"] == ["n2"], reports[0]
        assert findings[0]["direction"] == "both", reports[0]
        assert {r.get("at") for r in reports} == {reports[0]["at"]}  # one check for the job, shared
        assert len({i.node for i in incidents()}) == len(incidents())  # one incident per node
        others = [(i.kind.value, i.node) for node in NODES for i in list_incidents(tmp_path / node, "story")
                  if i.kind.value != "comm_regression"]
        assert others == [], others  # the probes on the slow link did not stall the job into a hang

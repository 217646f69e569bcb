"""One view of a job's incidents from anywhere (issue 23, item 5): `trainwarden incidents --etcd` against a real etcd
on loopback lists the incidents that two nodes' agents recorded (through the agents' own ``IncidentStore`` and
``EtcdWriter``), merged in time order with each one's node, and `show ID` finds one of the other node's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from trainwarden.agent.etcd.writer import EtcdWriter
from trainwarden.agent.incidents import Incident, IncidentKind, IncidentState, IncidentStore, new_incident_id

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _cli(*args: str, home) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRAINWARDEN_STATE_HOME": str(home)}  # empty: whatever is shown came from etcd
    return subprocess.run([sys.executable, "-m", "trainwarden.agent.cli", "incidents", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def _record(etcd_client, tmp_path, node: str, incidents: list[tuple[str, str, float]]) -> list[Incident]:
    """Record ``(job, kind, detected_at)`` as ``node``'s agent does: its state home and a copy to etcd."""
    writer = EtcdWriter(etcd_client, node=node)
    store = IncidentStore(state_dir=lambda job: tmp_path / node / "jobs" / job, etcd=writer)
    recorded = [store.record(Incident(id=new_incident_id(at), kind=kind, job=job, node=node, detected_at=at,
                                      state=IncidentState.OPEN, evidence={"summary": f"{kind.value} seen on {node}"}))
                for job, kind, at in incidents]
    assert writer.flush(30)
    writer.stop()
    return recorded


def test_incidents_of_two_nodes_merge_in_time_order_and_show_finds_the_other_nodes(etcd_server, etcd_client,
                                                                                     tmp_path):
    t = time.time() - 3600
    a = _record(etcd_client, tmp_path, "node-a", [("fleet", IncidentKind.HANG, t + 20),
                                                  ("fleet", IncidentKind.RESTART, t + 40),
                                                  ("elsewhere", IncidentKind.CRASH, t + 5)])
    b = _record(etcd_client, tmp_path, "node-b", [("fleet", IncidentKind.STRAGGLER_START, t + 10),
                                                  ("fleet", IncidentKind.STRAGGLER_END, t + 30)])
    etcd, empty = etcd_server.endpoint, tmp_path / "empty-home"
    assert "no incidents" in _cli(home=empty).stdout  # this machine's own state home has none

    out = _cli("--etcd", etcd, "--job", "fleet", "--json", home=empty)
    assert out.returncode == 0, out.stderr
    listed = [(i["node"], i["kind"]) for i in json.loads(out.stdout)]
    assert listed == [("node-b", "straggler_start"), ("node-a", "hang"), ("node-b", "straggler_end"),
                      ("node-a", "restart")]

    table = _cli("--etcd", etcd, "--job", "fleet", home=empty)
    assert table.returncode == 0, table.stderr
    header, *rows = table.stdout.splitlines()
    assert header.split()[:5] == ["ID", "KIND", "STATE", "JOB", "NODE"]
    assert [row.split()[4] for row in rows] == ["node-b", "node-a", "node-b", "node-a"]

    everything = json.loads(_cli("--etcd", etcd, "--json", home=empty).stdout)
    assert [i["id"] for i in everything] == [a[2].id, b[0].id, a[0].id, b[1].id, a[1].id]

    other = b[1]  # read from another node's point of view: node-a's state home knows nothing of it
    shown = _cli("--etcd", etcd, "show", other.id, home=tmp_path / "node-a")
    assert shown.returncode == 0, shown.stderr
    assert f"incident {other.id}: straggler_end in job fleet on node-b" in shown.stdout
    assert "straggler_end seen on node-b" in shown.stdout
    after = _cli("show", other.id[:22], "--etcd", etcd, "--json", home=empty)  # flags after `show`, an id prefix
    assert after.returncode == 0 and json.loads(after.stdout)["node"] == "node-b", after.stderr
    local = _cli("show", other.id, home=tmp_path / "node-a")  # without --etcd: this node's state home only
    assert local.returncode == 2 and "no incident matching" in local.stderr


def test_an_etcd_that_does_not_answer_is_exit_3_with_one_line(tmp_path):
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for args in (("--etcd", f"127.0.0.1:{port}"), ("--etcd", f"127.0.0.1:{port}", "show", "2026")):
        out = _cli(*args, home=tmp_path)
        assert out.returncode == 3, (out.stdout, out.stderr)
        assert out.stderr.startswith("trainwarden incidents: cannot reach etcd at") and \
            len(out.stderr.strip().splitlines()) == 1, out.stderr

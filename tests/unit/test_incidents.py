import io
import json
import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from trainwarden.agent.incidents import (IllegalIncidentTransition, Incident, IncidentCollector, IncidentKind,
                                         IncidentState, IncidentStore, list_incidents, new_incident_id)
from trainwarden.agent.cli.incidents import incidents_list, incidents_show
from trainwarden.agent.common.paths import job_state_dir

pytestmark = pytest.mark.timeout(30)


class FakeEtcd:
    def __init__(self, fail=False):
        self.kv, self.fail = {}, fail

    def put(self, key, value):
        if self.fail:
            raise ConnectionError("etcd is down")
        self.kv[key] = value

    def delete(self, key):
        if self.fail:
            raise ConnectionError("etcd is down")
        return self.kv.pop(key, None) is not None


def _hang(job="demo", ts=1_790_000_000.0, **kw):
    return Incident(id=new_incident_id(ts), kind=IncidentKind.HANG, job=job, node="n1", ranks=(5,),
                    detected_at=ts, updated_at=ts, evidence={"verdict": {
                        "culprits": [5], "summary": "rank 5 never entered all_reduce #11 of group tp",
                        "lags": [{"rank": 5, "group": "3", "desc": "tp", "seq": 10, "peer_seq": 11,
                                  "op": "all_reduce", "waiting": [4], "blocked": False}],
                        "unresponsive": {}, "stacks": {"5": ["hang (faults.py:120)", "train (train.py:40)"]}},
                        "stalled_seconds": 5.2}, **kw)


def test_ids_sort_by_time_and_are_unique():
    ids = [new_incident_id(1_790_000_000.0 + i * 0.001) for i in range(50)]
    assert ids == sorted(ids) and len(set(ids)) == 50
    assert len({new_incident_id(1_790_000_000.0) for _ in range(50)}) == 50
    assert new_incident_id(0).startswith("19700101T000000000Z-")


def test_lifecycle_transitions_follow_the_table():
    inc = _hang()
    acting = inc.transition(IncidentState.ACTING, action="abort", outcome="waiting", now=5.0)
    assert (acting.state, acting.action, acting.outcome, acting.updated_at) == (IncidentState.ACTING, "abort",
                                                                                "waiting", 5.0)
    assert inc.state is IncidentState.OPEN  # frozen: a new version
    done = acting.transition(IncidentState.RESOLVED, outcome="progressed")
    assert done.action == "abort"
    with pytest.raises(IllegalIncidentTransition, match="resolved -> acting"):
        done.transition(IncidentState.ACTING)
    with pytest.raises(IllegalIncidentTransition):
        inc.transition(IncidentState.FAILED).transition(IncidentState.RESOLVED)
    assert inc.transition(IncidentState.RESOLVED).state is IncidentState.RESOLVED


def test_json_round_trip_and_unknown_keys():
    inc = _hang()
    assert Incident.from_json(json.loads(json.dumps(inc.to_json()))) == inc
    with pytest.raises(ValueError, match="unknown keys"):
        Incident.from_json({**inc.to_json(), "colour": "red"})


def test_store_writes_files_mirrors_to_etcd_counts_and_logs(tmp_path, caplog):
    registry = CollectorRegistry()
    collector = IncidentCollector(node="n1")
    registry.register(collector)
    etcd = FakeEtcd()
    store = IncidentStore(state_dir=lambda job: job_state_dir(job, tmp_path), etcd=etcd, collector=collector)
    inc = _hang()
    with caplog.at_level(logging.WARNING, logger="trainwarden.agent.incidents.store"):
        store.record(inc)
        store.record(inc.transition(IncidentState.ACTING, action="abort"))  # same incident, newer version
    path = tmp_path / "jobs" / "demo" / "incidents" / f"{inc.id}.json"
    assert json.loads(path.read_text())["state"] == "acting"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary files left
    key = f"/trainwarden/v1/jobs/demo/incidents/{inc.id}"
    assert json.loads(etcd.kv[key])["state"] == "acting"
    assert sum(inc.id in r.getMessage() for r in caplog.records) == 1  # one log line per incident
    store.record(Incident(id=new_incident_id(), kind="straggler_start", job="demo", node="n1", ranks=(2,)))
    text = generate_latest(registry).decode()
    assert 'trainwarden_hangs_total{job="demo",node="n1"} 1.0' in text
    assert 'trainwarden_incidents_total{job="demo",kind="hang",node="n1"} 1.0' in text
    assert 'trainwarden_incidents_total{job="demo",kind="straggler_start",node="n1"} 1.0' in text
    assert 'trainwarden_incidents_total{job="demo",kind="crash",node="n1"} 0.0' in text  # every kind, from 0


def test_a_running_job_exports_every_incident_kind_at_zero_before_its_first_incident():
    """A counter born at 1 shows no increase(): the dashboards would miss the job's first incident."""
    registry = CollectorRegistry()
    jobs = ["train"]
    collector = IncidentCollector(node="n1", jobs=lambda: jobs)
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert 'trainwarden_hangs_total{job="train",node="n1"} 0.0' in text
    for kind in IncidentKind:
        assert f'trainwarden_incidents_total{{job="train",kind="{kind.value}",node="n1"}} 0.0' in text
    collector.count("train", IncidentKind.CRASH)
    jobs.clear()  # the job ended: its counts stay
    text = generate_latest(registry).decode()
    assert 'trainwarden_incidents_total{job="train",kind="crash",node="n1"} 1.0' in text


def test_etcd_failure_keeps_the_file(tmp_path):
    store = IncidentStore(state_dir=lambda job: job_state_dir(job, tmp_path), etcd=FakeEtcd(fail=True))
    inc = store.record(_hang())
    assert [i.id for i in list_incidents(tmp_path)] == [inc.id]


def test_list_incidents_by_home_job_and_job_dir(tmp_path):
    store = IncidentStore(state_dir=lambda job: job_state_dir(job, tmp_path))
    a1 = store.record(_hang("a", ts=1_790_000_002.0))
    a0 = store.record(_hang("a", ts=1_790_000_001.0))
    b = store.record(_hang("b", ts=1_790_000_000.0))
    (tmp_path / "jobs" / "b" / "incidents" / "broken.json").write_text("{not json")
    assert [i.id for i in list_incidents(tmp_path)] == [b.id, a0.id, a1.id]
    assert [i.id for i in list_incidents(tmp_path, job="a")] == [a0.id, a1.id]
    assert [i.id for i in list_incidents(job_state_dir("b", tmp_path))] == [b.id]
    assert list_incidents(tmp_path / "nothing-here") == []


def test_cli_table_json_and_show(tmp_path):
    store = IncidentStore(state_dir=lambda job: job_state_dir(job, tmp_path))
    inc = store.record(_hang().transition(IncidentState.ACTING, action="abort local workers (ranks 0-7)"))
    out = io.StringIO()
    assert incidents_list(out, root=tmp_path) == 0
    header, row = out.getvalue().splitlines()
    assert header.split()[:4] == ["ID", "KIND", "STATE", "JOB"] and row.split()[:5] == [inc.id, "hang", "acting",
                                                                                     "demo", "5"]
    out = io.StringIO()
    incidents_list(out, root=tmp_path, job="other")
    assert out.getvalue() == "no incidents for job other\n"
    out = io.StringIO()
    incidents_list(out, root=tmp_path, as_json=True)
    assert json.loads(out.getvalue())[0]["id"] == inc.id
    out = io.StringIO()
    assert incidents_show(out, inc.id[:22], root=tmp_path) == 0
    report = out.getvalue()
    assert "rank 5 never entered all_reduce #11" in report and "hang (faults.py:120)" in report
    assert "stalled_seconds: 5.2" in report
    err = io.StringIO()
    assert incidents_show(io.StringIO(), "nope", root=tmp_path, err=err) == 2
    assert "no incident matching 'nope'" in err.getvalue()


def test_unwritable_state_dir_does_not_stop_the_record(tmp_path):
    """A full disk or a bad state directory must not veto the action (abort) that follows the record."""
    from trainwarden.agent.incidents import Incident, IncidentKind, IncidentStore

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the state directory should be")
    store = IncidentStore(state_dir=lambda job: blocker)
    incident = Incident(id="20261122T000000000Z-abcdef", kind=IncidentKind.HANG, job="j", node="n", ranks=(2,))
    assert store.record(incident) is incident
    assert store.write_errors == 1


def test_exclusion_requests_are_recorded_and_withdrawn_in_files_and_etcd(tmp_path):
    etcd = FakeEtcd()
    store = IncidentStore(state_dir=lambda job: job_state_dir(job, tmp_path), etcd=etcd)
    store.request_exclusion("demo", "node-3", {"node": "node-3", "rank": 5, "reason": "straggler"})
    path = job_state_dir("demo", tmp_path) / "exclusions" / "node-3.json"
    assert json.loads(path.read_text())["rank"] == 5
    assert json.loads(etcd.kv["/trainwarden/v1/jobs/demo/exclude/node-3"])["reason"] == "straggler"
    store.withdraw_exclusion("demo", "node-3")
    assert not path.exists() and etcd.kv == {}
    down = IncidentStore(state_dir=lambda job: job_state_dir(job, tmp_path), etcd=FakeEtcd(fail=True))
    down.request_exclusion("demo", "node-3", {"node": "node-3"})   # etcd down: the file still holds it
    assert path.exists()
    down.withdraw_exclusion("demo", "node-3")
    assert not path.exists()


def test_show_puts_an_incidents_summary_first(tmp_path):
    from trainwarden.agent.cli.incidents import format_incident

    ts = 1_790_000_000.0
    incident = Incident(id=new_incident_id(ts), kind=IncidentKind.STRAGGLER_START, job="demo", node="n1", ranks=(6,),
                        detected_at=ts, updated_at=ts, evidence={
                            "summary": "rank 6 has been busy 91% of its time against its peers' 65%", "score": 1.35})
    text = format_incident(incident)
    assert "  summary:   rank 6 has been busy 91%" in text and "    score: 1.35" in text
    assert "summary:" not in text.split("evidence:")[1]


def test_an_etcd_that_hangs_does_not_hold_up_incidents(tmp_path):
    """An incident is written on the watchdog's thread just before an abort: its etcd copy is queued, never
    waited for (it used to be a synchronous put with a 5 s timeout per attempt)."""
    import threading
    import time

    from trainwarden.agent.etcd.writer import EtcdWriter
    from trainwarden.agent.incidents import Incident, IncidentKind, IncidentStore

    release = threading.Event()

    class HangingEtcd:
        def __init__(self):
            self.data = {}

        def put(self, key, value):
            release.wait(10)  # a partitioned etcd: the call hangs until its deadline
            self.data[key] = value

    etcd = HangingEtcd()
    writer = EtcdWriter(etcd)
    store = IncidentStore(state_dir=lambda job: tmp_path / job, etcd=writer)
    started = time.monotonic()
    for i in range(3):
        store.record(Incident(id=f"2026112{i}", kind=IncidentKind.HANG, job="j", node="n", detected_at=1.0))
    assert time.monotonic() - started < 1.0
    assert len(list((tmp_path / "j" / "incidents").glob("*.json"))) == 3  # the files are the record
    release.set()
    assert writer.flush(5) and len(etcd.data) == 3
    writer.stop()

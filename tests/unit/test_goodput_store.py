"""Where a job's goodput ledger outlives its launcher (agent/launch/goodput_store.py): which of the nodes' ledgers
is the job's, and what a new launcher resumes from when etcd or the state directory is missing or broken."""

from __future__ import annotations

import json
from types import SimpleNamespace

from trainwarden.agent.launch.goodput import GoodputLedger
from trainwarden.agent.launch.goodput_store import GoodputPublisher, choose, goodput_key, job_goodput, load_goodput


class _Etcd:
    """A fake etcd client: get_prefix and put over a dict (unit tests only)."""

    def __init__(self, fail: bool = False) -> None:
        self.data: dict[str, str] = {}
        self.fail = fail

    def put(self, key: str, value: str) -> None:
        self.data[key] = value

    def get_prefix(self, prefix: str):
        if self.fail:
            raise ConnectionError("etcd is away")
        return [(v.encode(), SimpleNamespace(key=k.encode())) for k, v in sorted(self.data.items())
                if k.startswith(prefix)]


def _state(launched: float, as_of: float, node: str) -> dict:
    return {"launched": launched, "as_of": as_of, "node": node, "productive_s": 1.0, "badput_s": {}}


def test_the_jobs_ledger_is_the_oldest_and_of_those_the_latest_word():
    grown = _state(50.0, 99.0, "c")  # a node that joined later and did not resume (no etcd then)
    assert choose([_state(0.0, 80.0, "a"), _state(0.0, 90.0, "b"), grown])["node"] == "b"
    assert choose([{"launched": "soon"}, {}]) is None and choose([]) is None


def test_a_launcher_resumes_from_etcd_or_the_state_directory_whichever_holds_the_job(tmp_path):
    etcd = _Etcd()
    ledger = GoodputLedger("gpt", launched_at=10.0, node="a")
    publisher = GoodputPublisher(etcd, "gpt", "a", ledger.state, period_s=3600)
    publisher.start()
    publisher.stop()  # publishes once at the end
    assert json.loads(etcd.data[goodput_key("gpt", "a")])["launched"] == 10.0
    etcd.data[goodput_key("gpt", "b")] = "{not json"
    etcd.data[goodput_key("other", "a")] = json.dumps(_state(0.0, 1.0, "x"))
    assert job_goodput(etcd, "gpt")["node"] == "a"
    local = tmp_path / "goodput.json"
    local.write_text(json.dumps(_state(5.0, 20.0, "local")))
    assert load_goodput(etcd, "gpt", local)["node"] == "local"  # the older ledger of the job
    assert load_goodput(_Etcd(fail=True), "gpt", local)["node"] == "local"  # etcd away: the file
    local.write_text("garbage")
    assert load_goodput(etcd, "gpt", local)["node"] == "a"
    assert load_goodput(None, "gpt", tmp_path / "missing.json") is None

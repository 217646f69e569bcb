"""etcd writes never stall the caller: queued, retried until etcd is back, coalesced per key."""

import threading
import time

import pytest

from trainwarden.agent.etcd.writer import EtcdWriter

pytestmark = pytest.mark.timeout(20)


class FlakyEtcd:
    """An etcd that is away until `back` is set, and then slow."""

    def __init__(self):
        self.back = threading.Event()
        self.data = {}
        self.order = []

    def put(self, key, value):
        if not self.back.is_set():
            raise ConnectionError("etcd is away")
        self.data[key] = value
        self.order.append(key)

    def delete(self, key):
        if not self.back.is_set():
            raise ConnectionError("etcd is away")
        self.data.pop(key, None)
        self.order.append(("del", key))


def test_writes_during_an_outage_return_at_once_and_land_when_etcd_is_back(caplog):
    etcd = FlakyEtcd()
    writer = EtcdWriter(etcd, endpoint="10.0.0.5:2379", backoff_initial_s=0.01, backoff_max_s=0.05)
    started = time.monotonic()
    for i in range(100):
        writer.put("/tw/jobs/j/state", f"phase {i}")  # one key: only the newest value matters
    writer.put("/tw/jobs/j/incidents/a", "hang")
    writer.delete("/tw/jobs/j/exclude/n1")
    assert time.monotonic() - started < 0.5  # nothing waited for etcd
    time.sleep(0.2)
    assert writer.pending() == 3 and not writer.up and writer.failures >= 1
    etcd.back.set()
    assert writer.flush(5)
    assert etcd.data == {"/tw/jobs/j/state": "phase 99", "/tw/jobs/j/incidents/a": "hang"}
    assert etcd.order == ["/tw/jobs/j/state", "/tw/jobs/j/incidents/a", ("del", "/tw/jobs/j/exclude/n1")]
    assert writer.up
    text = caplog.text
    assert "does not take writes" in text and "takes writes again" in text
    writer.stop()


def test_a_full_queue_drops_the_oldest_and_counts_it():
    etcd = FlakyEtcd()
    writer = EtcdWriter(etcd, max_pending=2, backoff_initial_s=0.01)
    for key in ("a", "b", "c"):
        writer.put(key, "v")
    assert writer.dropped == 1
    etcd.back.set()
    assert writer.flush(5) and set(etcd.data) == {"b", "c"}
    metrics = {m.name: m.samples[0].value for m in writer.collect()}
    assert metrics["trainwarden_etcd_writes_dropped"] == 1 and metrics["trainwarden_etcd_up"] == 1.0
    writer.stop()


def test_stop_gives_up_on_an_absent_etcd_within_its_timeout():
    writer = EtcdWriter(FlakyEtcd(), backoff_initial_s=0.01)
    writer.put("k", "v")
    started = time.monotonic()
    writer.stop(timeout=0.3)
    assert time.monotonic() - started < 2.0

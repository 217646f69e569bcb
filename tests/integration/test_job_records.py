"""Job records in a real etcd, across an etcd restart (the client must not blacklist its endpoint)."""

import pytest

from trainwarden.agent.etcd.client import split_endpoint
from trainwarden.agent.etcd.job_records import JobRecords, EtcdUnavailable, connect

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_job_records_survive_an_etcd_restart(etcd_server):
    store = JobRecords(connect(etcd_server.url), endpoint=etcd_server.endpoint)
    store.put_state("j", {"phase": "running", "generation": 0})
    etcd_server.kill()
    with pytest.raises(EtcdUnavailable, match=etcd_server.endpoint):
        store.put_state("j", {"phase": "running", "generation": 1})
    etcd_server.restart()
    store.put_state("j", {"phase": "succeeded", "generation": 1})  # at once, not after a 300 s blacklist
    assert store.get_state("j") == {"phase": "succeeded", "generation": 1}


def test_unreachable_and_malformed_endpoints():
    from trainwarden.agent.etcd.embedded import free_port

    with pytest.raises(EtcdUnavailable, match="cannot reach etcd at 127.0.0.1:"):
        connect(f"127.0.0.1:{free_port()}", timeout=1.0)
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        connect("localhost")
    with pytest.raises(EtcdUnavailable, match="cannot reach etcd at 127.0.0.1:"):  # TLS to a port nobody serves
        connect(f"https://127.0.0.1:{free_port()}", timeout=1.0)
    assert split_endpoint("http://[::1]:2379/") == ("::1", 2379, "http")

"""A per-job etcd user confined to its job's keys (agent/etcd/job_credentials.py; issue 44, item 8), enforced by a real
etcd with authentication on (the embedded one, whose root user makes it)."""

from __future__ import annotations

import pytest

from trainwarden.agent.etcd.client import EtcdAccessDenied, EtcdConfig, describe_etcd_error, open_etcd
from trainwarden.agent.etcd.embedded import EmbeddedEtcd
from trainwarden.agent.etcd.job_credentials import grant_job_user, job_user_names, revoke_job_user

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

P = "/trainwarden/v1"


@pytest.fixture
def auth_etcd(tmp_path):
    server = EmbeddedEtcd(data_dir=tmp_path / "etcd", log_path=tmp_path / "etcd.log", auth_dir=tmp_path / "auth")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _put(client, key: str) -> str:
    try:
        client.put(key, "x")
        return "written"
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return describe_etcd_error(exc)


def test_a_job_user_writes_its_own_jobs_keys_only_and_goes_with_its_generation(auth_etcd):
    root = open_etcd(auth_etcd.security.config((auth_etcd.endpoint,)))
    try:
        root.put(f"{P}/jobs/a/spec", '{"user": "alice"}')
        name = grant_job_user(root, "a", 1, "job-a-password-1", node="n0")
        job = open_etcd(EtcdConfig(endpoints=(auth_etcd.endpoint,), user=name, password="job-a-password-1"))
        try:
            for key in (f"{P}/rdzv/a/state", f"{P}/rdzv/a/rounds/00000000/nodes/n0", f"{P}/jobs/a/state",
                        f"{P}/jobs/a/nodes/n0", f"{P}/jobs/a/checkpoint", f"{P}/jobs/a/incidents/1",
                        f"{P}/jobs/a/spec2"):
                assert _put(job, key) == "written", key
            assert job.get(f"{P}/jobs/a/spec")[0] == b'{"user": "alice"}'  # it reads its spec
            root.put(f"{P}/jobs/a/control", '{"action": "stop", "generation": 1}')
            assert job.get(f"{P}/jobs/a/control")[0] == b'{"action": "stop", "generation": 1}'  # and its control
            with pytest.raises(Exception, match="permission denied"):
                job.delete(f"{P}/jobs/a/control")
            assert job.get(f"{P}/_probe")[0] is None  # the key every client reads to check that etcd serves it
            assert "permission denied" in _put(job, f"{P}/_probe")
            for key in (f"{P}/jobs/a/spec",  # but cannot choose who its next generation runs as,
                        f"{P}/jobs/a/control",  # delete or rewrite an operator's stop,
                        f"{P}/jobs/a/autoresume/00000001",  # nor the webhook's once-only resume record
                        f"{P}/jobs/b/spec", f"{P}/jobs/b/state", f"{P}/jobs/ab/state", f"{P}/rdzv/b/state",
                        f"{P}/rdzv/ab/state", f"{P}/nodes/n0", f"{P}/jobs/.index/a", "/elsewhere"):
                refused = _put(job, key)
                assert "permission denied" in refused, (key, refused)
            with pytest.raises(Exception, match="permission denied"):
                job.get(f"{P}/jobs/b/spec")
        finally:
            job.close()
        assert job_user_names(root, "n0") == {name} and job_user_names(root, "n1") == set()
        revoke_job_user(root, "a", 1, node="n0")
        revoke_job_user(root, "a", 1, node="n0")  # twice is harmless
        assert job_user_names(root, "n0") == set()
        with pytest.raises(EtcdAccessDenied):
            open_etcd(EtcdConfig(endpoints=(auth_etcd.endpoint,), user=name, password="job-a-password-1"))
        assert root.get(f"{P}/jobs/a/spec")[0] == b'{"user": "alice"}'
    finally:
        root.close()

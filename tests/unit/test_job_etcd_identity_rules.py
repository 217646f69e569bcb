"""A launcher's own etcd user, as the daemon makes and removes it (agent/node/job_etcd_identity.py; issue 44, item 8):
the names, the admin setting's checks, and the password file's directory, against a fake etcd auth API (a real etcd
enforces the role in tests/integration/test_job_credentials.py and test_job_etcd_identity.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import grpc
import pytest

from trainwarden.agent.etcd.job_credentials import job_permissions, job_user_name, parse_job_user_name
from trainwarden.agent.node.daemon import DaemonOptions
from trainwarden.agent.node.agent import AgentConfig
from trainwarden.agent.node.job_etcd_identity import (EtcdAdmin, JobEtcdIdentities, JobIdentityError,
                                                      shared_credential_note)

NOBODY = 65534


class _NotFound(grpc.RpcError):
    def details(self) -> str:
        return "etcdserver: user name not found"


class FakeAuth:
    """etcd's Auth service as far as the daemon calls it: users and roles by name."""

    def __init__(self) -> None:
        self.users: dict[str, str] = {}
        self.roles: dict[str, list] = {}
        self.calls: list[str] = []
        self.down = False

    def _do(self, method: str, request):
        self.calls.append(method)
        if self.down:
            raise grpc.RpcError("etcd away")
        if method == "RoleAdd":
            self.roles[request.name] = []
        elif method == "RoleGrantPermission":
            self.roles[request.name].append(request.perm)
        elif method == "UserAdd":
            self.users[request.name] = request.password
        elif method in ("UserDelete", "RoleDelete"):
            table, name = (self.users, request.name) if method == "UserDelete" else (self.roles, request.role)
            if name not in table:
                raise _NotFound()
            del table[name]
        elif method == "UserList":
            return type("R", (), {"users": list(self.users)})()
        elif method == "RoleList":
            return type("R", (), {"roles": list(self.roles)})()
        return None

    def __getattr__(self, method: str):
        return lambda request, *args, **kwargs: self._do(method, request)


class FakeClient:
    def __init__(self) -> None:
        self.authstub, self.timeout, self.call_credentials, self.metadata = FakeAuth(), 5.0, None, None
        self.closed = False

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake():
    return FakeClient()


@pytest.fixture
def identities(fake, tmp_path):
    return JobEtcdIdentities(fake, node="n0", state_home=tmp_path, launcher_args=["--etcd-ca", "/ca.pem"])


def test_a_job_users_name_carries_its_job_generation_and_node_and_nothing_else_parses():
    name = job_user_name("gpt-2.run-7", 12, "node-3.rack1")
    assert name == "trainwarden-job-gpt-2.run-7-12@node-3.rack1"
    assert parse_job_user_name(name) == ("gpt-2.run-7", 12, "node-3.rack1")
    for other in ("root", "trainwarden-agent", "trainwarden-job-a-1", "trainwarden-job-a-x@n0", "trainwarden-job-@n0"):
        assert parse_job_user_name(other) is None, other


def test_the_role_reads_its_jobs_keys_and_the_connection_probe_and_writes_them_but_spec_control_and_autoresume():
    perms = {(p.key.decode(), p.range_end.decode(), p.permType) for p in job_permissions("a")}
    rw, read = 2, 0  # READWRITE, READ
    j = "/trainwarden/v1/jobs/a/"
    assert perms == {("/trainwarden/v1/rdzv/a/", "/trainwarden/v1/rdzv/a0", rw),
                     (j, "/trainwarden/v1/jobs/a0", read),
                     (j, j + "autoresume/", rw), (j + "autoresume0", j + "control", rw),
                     (j + "control\0", j + "spec", rw), (j + "spec\0", "/trainwarden/v1/jobs/a0", rw),
                     ("/trainwarden/v1/_probe", "", read)}


def test_a_stop_request_holds_whatever_generation_the_state_is_made_to_say():
    """A running job's launcher writes its state; bumping the generation there must not void an operator's stop
    (submit and resume delete the request in the transaction that makes a new generation)."""
    from trainwarden.agent.etcd.jobs import JobView

    stop = {"action": "stop", "generation": 3, "by": "op"}
    assert JobView("j", state={"phase": "running", "generation": 3}, control=stop).stop_requested
    assert JobView("j", state={"phase": "running", "generation": 4}, control=stop).stop_requested
    assert not JobView("j", state={"phase": "running", "generation": 4}, control=None).stop_requested


def test_a_grant_writes_a_fresh_password_only_the_jobs_user_reads_and_gives_the_launcher_nothing_else(
        fake, identities, tmp_path):
    planted = tmp_path / "daemon" / "credentials" / "j"
    planted.mkdir(parents=True)
    secret = tmp_path / "secret"
    secret.write_text("root's\n")
    (planted / "etcd.password").symlink_to(secret)  # a killed daemon's directory holding a link: never followed
    flags = identities.grant("j", 3, NOBODY, NOBODY)
    name = "trainwarden-job-j-3@n0"
    path = planted / "etcd.password"
    assert flags == ["--etcd-ca", "/ca.pem", "--etcd-user", name, "--etcd-password-file", str(path)]
    assert secret.read_text() == "root's\n"
    assert path.read_text().strip() == fake.authstub.users[name] and len(path.read_text().strip()) >= 40
    file, folder, base = os.lstat(path), os.lstat(planted), os.lstat(planted.parent)
    assert stat.S_ISREG(file.st_mode) and stat.S_IMODE(file.st_mode) == 0o600 and file.st_uid == NOBODY
    assert stat.S_IMODE(folder.st_mode) == 0o700 and folder.st_uid == NOBODY
    assert stat.S_IMODE(base.st_mode) == 0o711 and base.st_uid == os.geteuid()
    assert len(fake.authstub.roles[name]) == len(job_permissions("j"))
    again = identities.grant("j", 3, NOBODY, NOBODY)  # a relaunch: the old user goes first
    assert again == flags and list(fake.authstub.users) == [name]


def test_a_revocation_removes_the_user_role_and_file_and_one_that_failed_is_retried(fake, identities, tmp_path):
    identities.grant("j", 1, NOBODY, NOBODY)
    fake.authstub.down = True
    identities.revoke("j", 1)
    assert not (tmp_path / "daemon" / "credentials" / "j").exists()  # the file goes at once
    assert "trainwarden-job-j-1@n0" in fake.authstub.users
    fake.authstub.down = False
    identities.retry()
    assert not fake.authstub.users and not fake.authstub.roles
    calls = len(fake.authstub.calls)
    identities.retry()
    assert len(fake.authstub.calls) == calls  # nothing left to retry


def test_a_grant_that_etcd_refuses_leaves_no_file_and_says_so(fake, identities, tmp_path):
    fake.authstub.down = True
    with pytest.raises(JobIdentityError, match="cannot make the etcd user of job j generation 1"):
        identities.grant("j", 1, NOBODY, NOBODY)
    assert not (tmp_path / "daemon" / "credentials" / "j").exists()


def test_the_sweep_keeps_adopted_launchers_and_this_nodes_only(fake, tmp_path):
    other = JobEtcdIdentities(fake, node="n1", state_home=tmp_path / "n1", launcher_args=[])
    mine = JobEtcdIdentities(fake, node="n0", state_home=tmp_path / "n0", launcher_args=[])
    for job, generation in (("kept", 2), ("gone", 1), ("old", 1)):
        mine.grant(job, generation, NOBODY, NOBODY)
    other.grant("gone", 1, NOBODY, NOBODY)
    fake.authstub.users["root"] = "x"
    mine.sweep({"kept": 2, "old": 2})  # "old" was adopted in a later generation
    assert sorted(fake.authstub.users) == ["root", "trainwarden-job-gone-1@n1", "trainwarden-job-kept-2@n0"]
    assert sorted(fake.authstub.roles) == ["trainwarden-job-gone-1@n1", "trainwarden-job-kept-2@n0"]
    assert sorted(os.listdir(tmp_path / "n0" / "daemon" / "credentials")) == ["kept"]


def test_the_admin_credential_is_both_settings_a_readable_file_and_root_reads_it_only(tmp_path):
    with pytest.raises(ValueError, match="go together"):
        EtcdAdmin(user="admin", password_file="")
    with pytest.raises(ValueError, match="etcd_admin_password_file.*cannot read"):
        EtcdAdmin(user="admin", password_file=str(tmp_path / "missing"))
    path = tmp_path / "admin.password"
    path.write_text("s3cret\n")
    path.chmod(0o640)
    with pytest.raises(ValueError, match=r"readable by others \(mode 0640\).*chmod 600"):
        EtcdAdmin(user="admin", password_file=str(path))
    path.chmod(0o600)
    admin = EtcdAdmin(user="admin", password_file=str(path))
    with pytest.raises(ValueError, match="give --etcd too"):
        DaemonOptions(agent=AgentConfig(socket_path=Path(tmp_path / "s.sock")), etcd_admin=admin)


def test_the_daemon_says_once_what_launchers_get_without_an_admin_credential():
    note = shared_credential_note(["--etcd-cert", "/a.pem", "--etcd-key", "/a-key.pem", "--insecure-etcd"])
    assert "the agents' etcd credential (--etcd-cert --etcd-key)" in note
    assert "etcd_admin_user" in note and "--etcd-admin-password-file" in note
    assert "no authentication" in shared_credential_note(["--insecure-etcd"])


def test_the_agent_refuses_half_an_admin_credential(capsys):
    from trainwarden.agent.cli.main import main

    assert main(["agent", "--etcd", "127.0.0.1:2379", "--etcd-admin-user", "admin"]) == 2
    assert "etcd_admin_user and etcd_admin_password_file go together" in capsys.readouterr().err

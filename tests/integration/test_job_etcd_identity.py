"""A daemon-run launcher holds only its own job's etcd credential (issue 44, item 8): a real root `trainwarden agent`
with the agents' user and an admin credential, a real etcd with authentication on (loopback), the job as ``nobody``.

Before this, every launcher got the agents' credential (its user could read it: the daemon refused a job otherwise),
so any job's user could submit a job as anyone or rewrite another job's rendezvous. Now the daemon makes an etcd user
for the job's launcher (agent/node/job_etcd_identity.py) and deletes it when the launcher is reaped. The job's worker
(tests/integration/etcd_probe_worker.py) takes the credential its launcher was given and tries another job's keys,
then trains the reference GPT with checkpoints: the job succeeds with only its own credential.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from job_users import NOBODY, interpreter_for_others, shared_dir, unavailable
from procs import wait_for
from test_daemon_jobs import Daemons, _cli
from trainwarden.agent.etcd.client import open_etcd
from trainwarden.agent.etcd.embedded import EmbeddedEtcd
from trainwarden.agent.etcd.job_credentials import job_user_names
from trainwarden.agent.etcd.jobs import JobControl

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

if unavailable():
    pytest.skip(unavailable(), allow_module_level=True)

NOBODY_UID = 65534
P = "/trainwarden/v1"
PROBE = Path(__file__).with_name("etcd_probe_worker.py")


@pytest.fixture
def shared(procs):
    path = shared_dir("tw-etcdjob-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def auth_etcd(tmp_path):
    """etcd with authentication on: root's password 0600 in a 0700 directory of root's (agent/etcd/embedded_auth.py)."""
    server = EmbeddedEtcd(data_dir=tmp_path / "auth-etcd", log_path=tmp_path / "auth-etcd.log", auth_dir=tmp_path / "auth")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def root(auth_etcd):
    client = open_etcd(auth_etcd.security.config((auth_etcd.endpoint,)))
    try:
        yield client
    finally:
        client.close()


def _agent_user(root, where: Path) -> Path:
    """The agents' role and user as deploy/etcd/roles.sh makes them, its password 0600 root's."""
    from etcd3 import etcdrpc
    from etcd3.etcdrpc import auth_pb2

    name = "trainwarden-agent"
    perm = auth_pb2.Permission(permType=auth_pb2.Permission.READWRITE, key=f"{P}/".encode(), range_end=f"{P}0".encode())
    for method, request in (("RoleAdd", etcdrpc.AuthRoleAddRequest(name=name)),
                            ("RoleGrantPermission", etcdrpc.AuthRoleGrantPermissionRequest(name=name, perm=perm)),
                            ("UserAdd", etcdrpc.AuthUserAddRequest(name=name, password="agent-password")),
                            ("UserGrantRole", etcdrpc.AuthUserGrantRoleRequest(user=name, role=name))):
        getattr(root.authstub, method)(request, root.timeout, credentials=root.call_credentials, metadata=root.metadata)
    path = where / "agent.password"
    path.write_text("agent-password\n")
    path.chmod(0o600)
    return path


def _phase(root, job: str) -> str:
    view = JobControl(root).job(job)
    return view.phase if view is not None else ""


def test_a_daemon_run_job_succeeds_with_only_its_own_etcd_user_which_cannot_write_another_jobs_keys(
        procs, shared, auth_etcd, root):
    etcd, admin_password = auth_etcd.endpoint, str(auth_etcd.password_file)
    agent_password = _agent_user(root, shared)
    root.put(f"{P}/jobs/victim/spec", '{"user": "alice"}')
    root.put(f"{P}/rdzv/victim/state", "victim's round")
    ckpt = shared / "ckpt"
    ckpt.mkdir()
    os.chown(ckpt, NOBODY_UID, NOBODY_UID)
    daemons = Daemons(procs, shared, etcd)
    try:
        daemons.start("n0", users=("--etcd-user", "trainwarden-agent", "--etcd-password-file", str(agent_password),
                                   "--etcd-admin-user", "root", "--etcd-admin-password-file", admin_password),
                      wrap=tuple(interpreter_for_others()))
        assert "launchers of submitted jobs get" not in daemons.log("n0")
        spec = shared / "own.toml"
        spec.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in dict(
            name="own", user=NOBODY, nnodes="1", nproc_per_node=1, max_restarts=0, checkpoint_dir=str(ckpt),
            command=[str(PROBE), "--batch", "4", "--steps", "10", "--ckpt-every", "5"]).items()) + "\n")
        out = _cli("submit", str(spec), "--etcd-user", "root", "--etcd-password-file", admin_password, etcd=etcd)
        assert out.returncode == 0, out.stderr
        try:
            wait_for(lambda: _phase(root, "own") in ("succeeded", "failed", "refused")
                     or "the launcher on node n0 exited" in daemons.log("n0"), 150, what="the job to end")
        finally:
            log = daemons.job_log("n0", "own")
            print(daemons.log("n0")[-4000:], log[-6000:], sep="\n---- job log\n")
        assert _phase(root, "own") == "succeeded", (JobControl(root).job("own").state, log[-4000:])
        (line,) = [line for line in log.splitlines() if line.startswith("PROBE ")]
        probe = json.loads(line[len("PROBE "):])

        assert probe["uid"] == NOBODY_UID
        assert probe["credential"]["user"] == "trainwarden-job-own-1@n0", probe["credential"]
        assert str(agent_password) not in json.dumps(probe["launcher"]) and "trainwarden-agent" not in probe["launcher"]
        assert set(probe["reads"].values()) == {"done"}, probe["reads"]  # only its own file was given
        puts = probe["puts"]
        assert puts.pop(f"{P}/jobs/own/probe") == "done", puts
        for key, result in puts.items():  # another job's spec and rendezvous, the index, its own spec
            assert "permission denied" in result, (key, result)
        assert probe["gets"][f"{P}/jobs/own/spec"] == "done"
        assert "permission denied" in probe["gets"][f"{P}/jobs/victim/spec"]
        assert root.get(f"{P}/jobs/victim/spec")[0] == b'{"user": "alice"}'
        assert root.get(f"{P}/rdzv/victim/state")[0] == b"victim's round"
        assert JobControl(root).job("own").checkpoint, "no checkpoint commit reached etcd"

        credentials = shared / "n0" / "daemon" / "credentials"
        wait_for(lambda: not job_user_names(root, "n0") and not any(credentials.iterdir()), 30,
                 what="the launcher's etcd user and password file to go once it was reaped")
        denied = [line for line in log.splitlines() if "permission denied" in line.lower() and "PROBE" not in line]
        assert not denied, denied  # the launcher needed nothing it was not granted
    finally:
        daemons.close()


def test_an_admin_credential_that_cannot_make_users_stops_the_agent_at_start(tmp_path, auth_etcd, root, etcd_server):
    """A wrong password, a user without the root role, an etcd without authentication: exit 2 and what to fix."""
    import subprocess
    import sys

    wrong = tmp_path / "wrong.password"
    wrong.write_text("not the password\n")
    wrong.chmod(0o600)
    agent_password = _agent_user(root, tmp_path)

    def agent(etcd: str, user: str, password: Path, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "trainwarden.agent.cli", "agent", "--etcd", etcd, "--node", "n0",
                               "--state-home", str(tmp_path / "home"), "--socket", str(tmp_path / "agent.sock"),
                               "--metrics-port", "0", "--etcd-admin-user", user, "--etcd-admin-password-file",
                               str(password), *extra], capture_output=True, text=True, timeout=60)

    out = agent(auth_etcd.endpoint, "root", wrong, "--etcd-user", "root", "--etcd-password-file",
                str(auth_etcd.password_file))
    assert out.returncode == 2 and "etcd_admin_user 'root'" in out.stderr and "etcd_admin_password_file" in out.stderr, \
        out.stderr
    out = agent(auth_etcd.endpoint, "trainwarden-agent", agent_password, "--etcd-user", "trainwarden-agent",
                "--etcd-password-file", str(agent_password))
    assert out.returncode == 2 and "grant it the root role" in out.stderr, out.stderr
    out = agent(etcd_server.endpoint, "root", wrong)
    assert out.returncode == 2 and "authentication off" in out.stderr, out.stderr

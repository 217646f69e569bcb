"""What a root daemon writes and changes about a job stays out of the job user's reach (issue 44, items 2, 4, 8):
a real root `trainwarden agent`, real etcd on loopback, jobs as ``nobody`` (and a test account in group ``disk``).

Each test plants what a job's user (or a stale run) could leave in the state home, then has the daemon refuse a
job, and checks that root neither wrote through a link nor gave anything away: before issue 44 the refusal's
incident was written through ``<state>/incidents`` wherever it pointed, ``hand_over`` followed no link but launched
the job in a state directory that was one, a state directory of another user was handed over with its contents,
and a member of ``disk`` ran jobs.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess

import pytest

from job_users import NOBODY, interpreter_for_others, shared_dir, unavailable
from procs import wait_for
from test_daemon_jobs import Daemons, _cli, _jobs
from trainwarden.agent.incidents import list_incidents

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

if unavailable():
    pytest.skip(unavailable(), allow_module_level=True)

NOBODY_UID = 65534


@pytest.fixture
def shared(procs):
    path = shared_dir("tw-records-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemons(procs, shared, etcd_server):
    d = Daemons(procs, shared, etcd_server.endpoint)
    try:
        yield d
    finally:
        d.close()


@pytest.fixture
def disk_user():
    """A real account in group ``disk`` (as good as root), removed after the test."""
    name = "twdisk44"
    subprocess.run(["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", "-G", "disk", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], check=False)


def _submit(shared, etcd, name: str, user: str, script) -> None:
    spec = shared / f"{name}.toml"
    spec.write_text(f'name = "{name}"\nuser = "{user}"\ncommand = ["{script}"]\n')
    out = _cli("submit", str(spec), etcd=etcd)
    assert out.returncode == 0, out.stderr


def _reason(etcd, name: str) -> str:
    return json.dumps(_jobs(etcd)[name])


@pytest.fixture
def planted(shared):
    """A script that must not run, a root-only directory, and ``<home>/jobs`` as the test plants it."""
    script = shared / "hello.py"
    script.write_text("print('this must not run', flush=True)\n")
    script.chmod(0o755)
    secret = shared / "root-only"
    secret.mkdir(mode=0o700)
    (secret / "keep").write_text("root's\n")
    jobs = shared / "n0" / "jobs"
    jobs.mkdir(parents=True)
    return script, secret, jobs


def _refused(daemons, etcd, home, secret, names) -> None:
    wait_for(lambda: {_jobs(etcd)[j]["phase"] for j in names} == {"refused"}, 90,
             what="the jobs to be refused: " + ", ".join(f"{j} {_jobs(etcd)[j]['phase']}" for j in names))
    assert sorted(p.name for p in secret.iterdir()) == ["keep"]  # nothing written through a link
    assert secret.stat().st_uid == 0 and (secret / "keep").stat().st_uid == 0
    assert stat.S_IMODE(secret.stat().st_mode) == 0o700
    for name in names:
        assert "this must not run" not in daemons.job_log("n0", name)
        records = home / "daemon" / "records" / name / "incidents"
        (found,) = list(records.glob("*.json"))
        assert json.loads(found.read_text())["kind"] == "job_refused"
        assert found.stat().st_uid == 0 and stat.S_IMODE(found.stat().st_mode) == 0o644
        assert stat.S_IMODE(records.stat().st_mode) == 0o755
        assert [i.kind.value for i in list_incidents(home, name)] == ["job_refused"]  # `trainwarden incidents`


def test_a_refusal_is_recorded_outside_the_job_tree_never_through_a_planted_link(daemons, shared, etcd_server,
                                                                                 planted):
    """Item 2: the user's state directory with ``incidents`` and ``diagnostics`` pointing at a root-only one."""
    etcd = etcd_server.endpoint
    script, secret, jobs = planted
    evil = jobs / "evil"
    evil.mkdir()
    for name in ("incidents", "diagnostics"):
        (evil / name).symlink_to(secret)
        os.lchown(evil / name, NOBODY_UID, NOBODY_UID)
    os.chown(evil, NOBODY_UID, NOBODY_UID)
    daemons.start("n0", users=(), wrap=tuple(interpreter_for_others()))
    _submit(shared, etcd, "evil", "root", script)  # refused: it would run as root
    _refused(daemons, etcd, shared / "n0", secret, ("evil",))


def test_a_linked_or_taken_state_directory_and_a_privileged_user_are_refused(daemons, shared, etcd_server, planted,
                                                                            disk_user):
    """Items 4 and 8: a state directory that is a link to root's directory; one of another user (with that run's
    files); a user in group ``disk``."""
    etcd = etcd_server.endpoint
    script, secret, jobs = planted
    (jobs / "linked").symlink_to(secret)
    (jobs / "taken").mkdir()
    (jobs / "taken" / "ckpt").write_text("someone else's\n")
    os.chown(jobs / "taken", 12345, 12345)
    os.chown(jobs / "taken" / "ckpt", 12345, 12345)
    daemons.start("n0", users=(), wrap=tuple(interpreter_for_others()))
    _submit(shared, etcd, "linked", NOBODY, script)
    _submit(shared, etcd, "taken", NOBODY, script)
    _submit(shared, etcd, "privy", disk_user, script)
    _refused(daemons, etcd, shared / "n0", secret, ("linked", "taken", "privy"))
    linked = _reason(etcd, "linked")
    assert "cannot open the state directory" in linked and "not followed" in linked
    taken = _reason(etcd, "taken")
    assert "belongs to" in taken and "uid 12345" in taken and f"chown -R nobody: {jobs / 'taken'}" in taken
    assert (jobs / "taken").stat().st_uid == 12345 and (jobs / "taken" / "ckpt").stat().st_uid == 12345
    privy = _reason(etcd, "privy")
    assert "member of group 'disk'" in privy and "job_users" in privy

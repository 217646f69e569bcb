"""Who a daemon-run job runs as (agent/node/job_user.py, issue 30 item 1): the rules, against this machine's real
user database (root and nobody exist on every Linux system), and the file checks on real files."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from trainwarden.agent.node.job_user import (JobUser, JobUserRefused, hand_over, launch_identity, readable_by,
                                              resolve_job_user, writable_by)

NOBODY = JobUser(name="nobody", uid=65534, gid=65534, groups=(65534,), home="/nonexistent")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="changes file owners: needs root")


def test_the_spec_user_wins_then_the_node_default_and_uids_work_as_names():
    assert resolve_job_user("nobody", default="root", allow_root=True, agent_uid=0).uid == 65534
    assert resolve_job_user(None, default="nobody", allow_root=False, agent_uid=0).name == "nobody"
    assert resolve_job_user(65534, default=None, allow_root=False, agent_uid=0).name == "nobody"
    assert resolve_job_user(None, default="65534", allow_root=False, agent_uid=0).name == "nobody"  # a flag's text


def test_root_is_refused_unless_allowed_and_so_is_a_job_with_no_user_on_a_root_agent():
    with pytest.raises(JobUserRefused, match="would run as root.*allow_root_jobs"):
        resolve_job_user("root", default=None, allow_root=False, agent_uid=0)
    with pytest.raises(JobUserRefused, match="would run as root"):
        resolve_job_user(None, default="root", allow_root=False, agent_uid=0)
    assert resolve_job_user(0, default=None, allow_root=True, agent_uid=0).uid == 0
    with pytest.raises(JobUserRefused, match="names no user.*job_user"):
        resolve_job_user(None, default=None, allow_root=True, agent_uid=0)


def test_an_agent_that_is_not_root_runs_jobs_as_itself_and_refuses_anyone_else():
    assert resolve_job_user(None, default=None, allow_root=False, agent_uid=65534).uid == 65534
    with pytest.raises(JobUserRefused, match="runs as uid 65534 and can start processes only as itself"):
        resolve_job_user("root", default=None, allow_root=True, agent_uid=65534)


def test_an_unknown_user_is_named():
    with pytest.raises(JobUserRefused, match="no user 'no-such-user-x' on this node"):
        resolve_job_user("no-such-user-x", default=None, allow_root=False, agent_uid=0)


def test_mode_bits_decide_what_the_user_may_write_and_read(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    assert not writable_by(d, NOBODY) and not writable_by(d / "not" / "yet", NOBODY)
    os.chmod(d, 0o777)
    assert writable_by(d, NOBODY) and writable_by(d / "not" / "yet", NOBODY)  # the nearest parent decides
    secret = tmp_path / "password"
    secret.write_text("x")
    os.chmod(secret, 0o600)
    assert not readable_by(secret, NOBODY) and readable_by(secret, JobUser("root", 0, 0, (0,), "/root"))
    os.chmod(secret, 0o604)
    assert readable_by(secret, NOBODY)


@needs_root
def test_hand_over_changes_the_tree_and_never_follows_a_link(tmp_path):
    job = tmp_path / "jobs" / "j"
    (job / "incidents").mkdir(parents=True)
    (job / "incidents" / "a.json").write_text("{}")
    outside = tmp_path / "outside"
    outside.write_text("root's")
    (job / "link").symlink_to(outside)
    (job / "dirlink").symlink_to(tmp_path)
    hand_over(job, NOBODY)
    for path in (job, job / "incidents", job / "incidents" / "a.json"):
        assert path.stat().st_uid == 65534, path
    assert os.lstat(job / "link").st_uid == 0  # the user's content (here a link) is not touched (issue 44)
    assert outside.stat().st_uid == 0 and tmp_path.stat().st_uid == 0  # never what it points at


def test_launching_as_another_user_sets_its_identity_and_drops_the_service_variables():
    env = {"PATH": "/usr/bin", "NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "1", "HOME": "/root"}
    same = launch_identity(JobUser("me", os.geteuid(), os.getegid(), (), os.environ.get("HOME", "/")), env)
    assert same.env == {"PATH": "/usr/bin", "HOME": "/root"} and not same.switches
    assert same.argv(["x", "y"]) == ["x", "y"]
    other = launch_identity(NOBODY if os.geteuid() != 65534 else JobUser("root", 0, 0, (0,), "/root"), env)
    assert other.switches and "NOTIFY_SOCKET" not in other.env and other.env["USER"] in ("nobody", "root")
    assert other.argv(["x"])[-1] == "x"


@pytest.mark.skipif(os.geteuid() != 0, reason="switches to another user: needs root")
def test_the_switched_launch_is_a_vfork_and_runs_with_the_users_uid_gid_and_groups(monkeypatch):
    """Issue 45: Popen(user=..., group=..., extra_groups=...) cannot vfork, so the root daemon forked itself, gRPC's
    threads and all, and 1 launch in 60 aborted in gRPC's poller before exec. The identity is switched after exec."""
    calls = []
    real = subprocess._fork_exec

    def recording(*args):
        # (..., process_group, gid, extra_groups, uid, umask, preexec_fn, allow_vfork)
        calls.append(args[-6:-3] + args[-2:])
        return real(*args)

    monkeypatch.setattr(subprocess, "_fork_exec", recording)
    user = JobUser("nobody", 65534, 65534, (65534, 4242), "/nonexistent")
    identity = launch_identity(user, {"PATH": os.environ.get("PATH", "/usr/bin")})
    # the launcher is started by an absolute path of an interpreter every user may run
    proc = subprocess.Popen(identity.argv(["/bin/cat", "/proc/self/status"]), stdout=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True, env=identity.env)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert calls and all(c == (None, None, None, None, True) for c in calls), calls  # nothing that forbids vfork
    status = {line.split(":")[0]: line.split()[1:] for line in out.splitlines()}
    assert status["Uid"] == ["65534"] * 4 and status["Gid"] == ["65534"] * 4
    assert sorted(status["Groups"]) == ["4242", "65534"]
    assert status["CapEff"] == ["0000000000000000"]


@pytest.mark.skipif(os.geteuid() != 0, reason="switches to another user: needs root")
def test_an_identity_that_cannot_be_taken_never_runs_the_command(tmp_path):
    marker = tmp_path / "ran"
    user = JobUser("nobody", 65534, 65534, (-5,), "/nonexistent")  # an impossible group: setgroups fails
    identity = launch_identity(user, {"PATH": "/usr/bin:/bin"})
    proc = subprocess.run(identity.argv(["touch", str(marker)]), capture_output=True, text=True, timeout=60,
                          env=identity.env)
    assert proc.returncode != 0 and not marker.exists()


def test_no_new_privileges_is_set_in_the_process_that_asks():
    code = ("from trainwarden.agent.node.job_user import no_new_privileges; assert no_new_privileges(); "
            "print([l for l in open('/proc/self/status') if l.startswith('NoNewPrivs')][0].split()[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr


@needs_root
def test_a_member_of_a_privileged_group_is_refused_unless_named_and_the_allow_list_holds():
    """issue 44 item 8: a user in `disk` (as good as root) is refused by default; the refusal names the group and
    the setting that allows it. A real account and group, made for the test and removed after."""
    group, name = "twdisk44", "twjob44"
    subprocess.run(["groupadd", "-f", group], check=True)
    subprocess.run(["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", "-G", f"disk,{group}", name], check=True)
    try:
        with pytest.raises(JobUserRefused, match=r"member of group 'disk'.*job_users.*privileged_groups"):
            resolve_job_user(name, default=None, allow_root=False, agent_uid=0)
        assert resolve_job_user(name, default=None, allow_root=False, agent_uid=0, users=(name,)).name == name
        assert resolve_job_user(name, default=None, allow_root=False, agent_uid=0,
                                privileged_groups=("docker",)).name == name
        with pytest.raises(JobUserRefused, match=r"not allowed to run jobs.*job_users"):
            resolve_job_user("nobody", default=None, allow_root=False, agent_uid=0, groups=(group,))
        assert resolve_job_user(name, default=None, allow_root=False, agent_uid=0, groups=(group,),
                                privileged_groups=()).name == name
        assert resolve_job_user("nobody", default=None, allow_root=False, agent_uid=0).uid == 65534
    finally:
        subprocess.run(["userdel", name], check=False)
        subprocess.run(["groupdel", group], check=False)

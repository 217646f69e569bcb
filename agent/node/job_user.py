"""Who a daemon-run job runs as (issue 30): the node daemon is root, and a job spec in etcd must not make it run code
as root on every node.

A spec names ``user`` (a name or a uid on the nodes); a spec without one runs as the node's ``job_user`` (the shipped
configs name a non-root system user). Root only where the agent's config says ``allow_root_jobs = true``. A root
daemon with neither a spec ``user`` nor a ``job_user`` refuses the job, as it refuses root; a daemon that is not root
can only start processes as itself, so that is its default and anything else is refused. A refusal is the daemon's
usual one (agent/node/job_refusal.py): a phase and one incident that say why.

**Who may be named** (issue 44). When the agent's ``job_users`` or ``job_groups`` are set, only those users and
members of those groups run jobs; by default no member of a ``privileged_groups`` group (docker, disk, lxd, sudo,
wheel, adm, root: as good as root) does unless ``job_users`` names it. A job whose state directory exists and belongs
to another user is refused (``state_dir_problem``) until an operator removes or reassigns it.

The launcher is started with the user's uid, gid and groups, switched after exec by a few lines of Python run with
``-I -S`` (``launch_identity``; leaving uid 0 clears every capability), and sets no-new-privileges itself before
anything else runs (``no_new_privileges``, `trainwarden run --managed`). Not ``subprocess.Popen``'s
``user``/``group``/``extra_groups``: with them CPython cannot use ``vfork`` and forks the daemon, gRPC's threads and
all, and a forked copy of a process with live gRPC threads can abort in gRPC's poller before it execs (issue 45: 1 of
60 launches). Without them the daemon's Popen is a ``vfork``: nothing of the daemon runs in the child before exec. Its state directory and log become the user's
(``hand_over``: only what root made, by descriptor, never following a link; a failure refuses the job);
``writable_by`` says whether the user may write the job's checkpoint directory before it starts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import grp
import logging
import os
import pwd
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from trainwarden.agent.common.untrusted_fs import open_dir

logger = logging.getLogger(__name__)

__all__ = ["HandOverError", "JobUser", "JobUserRefused", "LaunchIdentity", "PRIVILEGED_GROUPS", "ROOT_MADE",
           "hand_over", "launch_identity", "names", "no_new_privileges", "readable_by", "resolve_job_user",
           "state_dir_problem", "writable_by"]


class JobUserRefused(ValueError):
    """This node will not run the job as the user it asks for (or as anyone): the message says why and what to do."""


@dataclass(frozen=True)
class JobUser:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    def __str__(self) -> str:
        return f"{self.name} (uid {self.uid})"

    def env(self) -> dict[str, str]:
        """What a login would set: the launcher's HOME, USER and LOGNAME."""
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}


PRIVILEGED_GROUPS = ("docker", "disk", "lxd", "sudo", "wheel", "adm", "root")
"""Groups whose members are as good as root on most hosts (the docker socket, raw disks, lxd, sudo, logs): by
default no job runs as a member (the agent's ``privileged_groups``)."""


def names(text: str | None) -> tuple[str, ...]:
    """A comma-separated setting (``job_users = "alice,bob"``) as a tuple of names."""
    return tuple(part.strip() for part in (text or "").split(",") if part.strip())


def resolve_job_user(wanted: str | int | None, *, default: str | None, allow_root: bool,
                     agent_uid: int | None = None, users: tuple[str, ...] = (), groups: tuple[str, ...] = (),
                     privileged_groups: tuple[str, ...] = PRIVILEGED_GROUPS) -> JobUser:
    """The user to start a job as (module docstring); ``JobUserRefused`` otherwise. ``users``, ``groups``: when
    either is given, only those users (names or uids) and the members of those groups may run jobs here; a member
    of ``privileged_groups`` only when ``users`` names it."""
    agent_uid = os.geteuid() if agent_uid is None else agent_uid
    user = _resolve(wanted, default=default, allow_root=allow_root, agent_uid=agent_uid)
    if user.uid == 0 or agent_uid != 0:  # allow_root_jobs said so; an agent that is not root runs jobs as itself
        return user
    listed = user.name in users or str(user.uid) in users
    if (users or groups) and not listed and not set(user.groups) & _gids(groups):
        raise JobUserRefused(f"{user} is not allowed to run jobs on this node: the agent's job_users "
                             f"({', '.join(users) or 'none'}) and job_groups ({', '.join(groups) or 'none'}) name "
                             "neither it nor a group of it; add it to job_users (or its group to job_groups) in the "
                             "agent config, or submit the job with another user")
    for group in privileged_groups:
        gid = _gid(group)
        if gid is not None and gid in user.groups and not listed:
            raise JobUserRefused(f"{user} is a member of group {group!r}, which is as good as root on this node: "
                                 "name the user in job_users in the agent config if it may run jobs anyway (or "
                                 f"take {group!r} out of privileged_groups), or submit the job with another user")
    return user


def _gid(group: str) -> int | None:
    try:
        return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        return None


def _gids(groups: tuple[str, ...]) -> set[int]:
    return {gid for gid in map(_gid, groups) if gid is not None}


def _resolve(wanted: str | int | None, *, default: str | None, allow_root: bool,
             agent_uid: int | None = None) -> JobUser:
    agent_uid = os.geteuid() if agent_uid is None else agent_uid
    if wanted is None:
        wanted = default
    if isinstance(wanted, str) and wanted.isdigit():  # a uid given as text (a flag, an environment variable)
        wanted = int(wanted)
    if wanted is None:
        if agent_uid != 0:
            return _lookup(agent_uid)
        raise JobUserRefused("its spec names no user and this node's agent has no job_user to run it as: set "
                             "`user = \"...\"` in the spec, or job_user in the agent config (a non-root system user, "
                             "e.g. trainwarden-job)")
    user = _lookup(wanted)
    if user.uid == 0 and not allow_root:
        raise JobUserRefused("it would run as root, which this node's agent does not allow: set `user` in the spec to "
                             "the user the job is for (or allow_root_jobs = true in the agent config, if every writer "
                             "of the jobs/ keys in etcd may be root on this node)")
    if agent_uid != 0 and user.uid != agent_uid:
        raise JobUserRefused(f"it asks to run as {user}, but this node's agent runs as uid {agent_uid} and can start "
                             "processes only as itself: run the agent as root, or submit the job with its user")
    return user


def _lookup(who: str | int) -> JobUser:
    try:
        entry = pwd.getpwuid(who) if isinstance(who, int) else pwd.getpwnam(who)
    except KeyError:
        raise JobUserRefused(f"there is no user {who!r} on this node: create it (the same uid on every node) or "
                             "change `user` in the spec") from None
    try:
        groups = tuple(os.getgrouplist(entry.pw_name, entry.pw_gid))
    except OSError:
        groups = (entry.pw_gid,)
    return JobUser(name=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid, groups=groups, home=entry.pw_dir)


def _allows(st: os.stat_result, user: JobUser, owner_bits: int) -> bool:
    """Whether mode bits ``owner_bits`` (given in the owner's class, e.g. ``S_IRUSR``) are set in the class the
    kernel applies to ``user`` for a file with status ``st`` (owner, group, others; root passes; ACLs aside)."""
    if user.uid == 0:
        return True
    shift = 0 if st.st_uid == user.uid else 3 if st.st_gid in user.groups else 6
    bits = owner_bits >> shift
    return st.st_mode & bits == bits


def writable_by(path: str | os.PathLike, user: JobUser) -> bool:
    """Whether ``user`` may create files in directory ``path``. A path that does not exist yet counts as its
    nearest existing parent."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = path.stat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and _allows(st, user, stat.S_IWUSR | stat.S_IXUSR)


def readable_by(path: str | os.PathLike, user: JobUser) -> bool:
    """Whether ``user`` may read file ``path`` (the directories above it are not looked at)."""
    try:
        return _allows(os.stat(path), user, stat.S_IRUSR)
    except OSError:
        return False


def state_dir_problem(state: str | os.PathLike, user: JobUser) -> str | None:
    """Why job state directory ``state`` may not become ``user``'s (None: it may): it exists and belongs to another
    user (a job name reused by someone else would inherit that run's state and checkpoints). One of this process's
    own (root's) holding nothing but ``ROOT_MADE`` (the daemon made it, or an older release kept its records there)
    is handed over; one holding more (a run as root) is another user's."""
    try:
        st = os.lstat(state)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"its state directory {state} cannot be looked at: {exc.strerror or exc}"
    owner = st.st_uid
    if owner == user.uid:
        return None
    if owner == os.geteuid():
        if not stat.S_ISDIR(st.st_mode):
            return None  # a link or a special file: ``hand_over`` refuses it, saying so
        try:
            if set(os.listdir(state)) <= set(ROOT_MADE):
                return None
        except OSError:
            pass
    try:
        name = pwd.getpwuid(owner).pw_name
    except KeyError:
        name = "an unknown user"
    return (f"its state directory {state} belongs to {name} (uid {owner}), not to {user}: a job name reused by "
            f"another user would inherit that run's state and checkpoints; an operator removes it (`rm -r {state}`) "
            f"or gives it to the new user (`chown -R {user.name}: {state}`), then `trainwarden resume` the job")


ROOT_MADE = ("incidents", "diagnostics", "exclusions")
"""The directories root itself made inside a job's state directory before its records moved out of it (issue 44):
handed over with it, so that the job's own launcher may write there."""


class HandOverError(OSError):
    """The state directory cannot be given to the job's user safely (a link, not a directory, a failed chown): the
    job is refused with this message."""


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


def hand_over(path: str | os.PathLike, user: JobUser, *, under: str | os.PathLike | None = None) -> None:
    """Make job state directory ``path`` ``user``'s: the directory itself and what root made in it (``ROOT_MADE``
    and the regular files and directories root owns directly inside those), nothing the user made. Everything is
    reached by descriptor (``openat`` with ``O_NOFOLLOW|O_DIRECTORY|O_NONBLOCK`` from ``under``, a directory of
    root's own, agent/common/untrusted_fs.py) and changed with ``fchown`` on that descriptor: a link is never
    followed, a FIFO or a device never opened for long (nor blocks), a file with a second hard link (it may be
    someone else's) is left alone, and a directory swapped for something else meanwhile is skipped.
    ``HandOverError`` when ``path`` itself cannot be opened so or changed."""
    try:
        fd = open_dir(path, under=under)
    except OSError as exc:
        raise HandOverError(exc.errno, f"cannot open the state directory {path} without following a link "
                                       f"({exc.strerror or exc}); remove it (or make it a directory) and resume the "
                                       "job") from None
    try:
        try:
            os.fchown(fd, user.uid, user.gid)
        except OSError as exc:
            raise HandOverError(exc.errno, f"cannot give {path} to {user}: {exc.strerror or exc}") from None
        for name in ROOT_MADE:
            _hand_over_entry(fd, name, user, depth=2)
    finally:
        os.close(fd)


def _hand_over_entry(parent: int, name: str, user: JobUser, *, depth: int) -> None:
    """``fchown`` entry ``name`` of directory descriptor ``parent`` to ``user`` if root made it (a regular file
    with one link, or a directory, owned by this process's uid), and ``depth - 1`` levels of what root made in it."""
    try:
        before = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError:
        return
    is_dir = stat.S_ISDIR(before.st_mode)
    if before.st_uid != os.geteuid() or not (is_dir or (stat.S_ISREG(before.st_mode) and before.st_nlink == 1)):
        return  # the user's, a link, a special file, or a file someone else may hold a link to
    try:
        fd = os.open(name, _DIR_FLAGS if is_dir else _FILE_FLAGS, dir_fd=parent)
    except OSError:  # swapped for a link or something else since the stat
        return
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino) or (not is_dir and st.st_nlink != 1):
            return
        os.fchown(fd, user.uid, user.gid)
        if is_dir and depth > 1:
            for entry in os.listdir(fd):
                _hand_over_entry(fd, entry, user, depth=depth - 1)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class LaunchIdentity:
    """How to start a command as a job's user: ``argv(cmd)`` is what to run, ``env`` its environment."""

    env: dict[str, str]
    prefix: tuple[str, ...] = ()  # the identity switch to exec first; () when the command runs as this process

    def argv(self, cmd: list[str]) -> list[str]:
        return [*self.prefix, *cmd]

    @property
    def switches(self) -> bool:
        return bool(self.prefix)


# Run by the daemon's own interpreter with -I -S (no site, no environment variables, nothing of the job's): set the
# groups, then the gid, then the uid (in that order: after the uid nothing else may be changed), then exec the command.
# Any failure raises before the exec, so the command never runs with an identity half switched.
_SWITCH = ("import os, sys\n"
           "uid, gid = int(sys.argv[1]), int(sys.argv[2])\n"
           "os.setgroups([int(g) for g in sys.argv[3].split(',') if g])\n"
           "os.setresgid(gid, gid, gid)\n"
           "os.setresuid(uid, uid, uid)\n"
           "os.execvp(sys.argv[4], sys.argv[4:])\n")


def launch_identity(user: JobUser, environ: dict[str, str], *, python: str | None = None) -> LaunchIdentity:
    """How to start a process as ``user`` with ``environ`` (nothing to switch when that is who this process is
    already): its uid, gid and groups switched after exec (module docstring), HOME/USER/LOGNAME, and none of the
    service manager's variables (a job has no business notifying systemd as the agent)."""
    env = {k: v for k, v in environ.items() if k not in _SERVICE_ENV}
    if user.uid == os.geteuid():
        return LaunchIdentity(env=env)
    groups = ",".join(str(g) for g in user.groups)
    prefix = (python or sys.executable, "-I", "-S", "-c", _SWITCH, str(user.uid), str(user.gid), groups)
    return LaunchIdentity(env={**env, **user.env()}, prefix=prefix)


_SERVICE_ENV = frozenset({"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID",
                          "LISTEN_FDNAMES", "INVOCATION_ID"})

_PR_SET_NO_NEW_PRIVS = 38


def no_new_privileges() -> bool:
    """Set this process's no-new-privileges bit (Linux): nothing it or its children exec (a setuid binary, a file
    with capabilities) can gain privileges. False where it cannot be set."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        return libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


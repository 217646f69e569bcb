"""Each daemon-run launcher's own etcd credential (issue 44, item 8).

A launcher needs etcd (its rendezvous, its job's state, checkpoint commits, incidents), and it runs as the job's
user. Given the agents' credential, every job's user could act as an agent: submit a job as anyone (``jobs/``) or
rewrite another job's rendezvous. With an admin credential (``etcd_admin_user``, ``etcd_admin_password_file``: a
user with etcd's root role, read by root only), the daemon gives each launcher an etcd user of its own instead:

* **grant**, before each start of a launcher: an etcd user and role for the job, generation and node
  (agent/etcd/job_credentials.py: its job's keys only), with a random 256-bit password written 0600 in
  ``<state home>/daemon/credentials/<job>/etcd.password``. Root makes that directory afresh (0700) inside
  ``daemon/credentials`` (root's, 0711), reached by descriptor without following a link, and gives the directory
  and the file to the job's user: nothing there existed before root made it, so the user cannot have planted
  anything. The launcher gets that user, that file and the CA; never the agents' certificate or password.
* **revoke**, when the daemon reaps the launcher: the user and role are deleted and the directory removed (without
  following a link). A revocation that fails (etcd away) is tried again each round.
* **sweep**, when the daemon starts: the job users of this node and the directories of jobs whose launcher it did
  not adopt (a daemon killed meanwhile) are removed.

Without an admin credential the launchers get the daemon's own etcd flags, as before, and the daemon says so once
when it starts (docs/SECURITY.md, "etcd: who may write which keys").
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from trainwarden.agent.etcd.client import EtcdConfig, describe_etcd_error, read_password_file
from trainwarden.agent.etcd.job_credentials import (grant_job_user, job_user_name, job_user_names,
                                                    parse_job_user_name, revoke_job_user)
from trainwarden.agent.etcd.keys import DEFAULT_PREFIX

logger = logging.getLogger(__name__)

__all__ = ["CREDENTIALS_DIR", "EtcdAdmin", "JobEtcdIdentities", "JobIdentityError", "PASSWORD_NAME", "open_admin",
           "shared_credential_note"]

CREDENTIALS_DIR = "credentials"
"""``<state home>/daemon/credentials/<job>/``: a launcher's etcd password, its user's alone."""
PASSWORD_NAME = "etcd.password"

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class JobIdentityError(Exception):
    """A launcher's etcd user could not be made (etcd away, or it refused the admin): retried next round."""


@dataclass(frozen=True, kw_only=True)
class EtcdAdmin:
    """The daemon's admin credential: an etcd user with the root role, which makes and deletes launchers' users."""

    user: str
    """The etcd user (``etcd_admin_user``)."""
    password_file: str = field(repr=True)
    """File holding its password, readable by root only (``etcd_admin_password_file``)."""

    def __post_init__(self) -> None:
        if not self.user or not self.password_file:
            raise ValueError("etcd_admin_user and etcd_admin_password_file go together; give both or neither")
        try:
            read_password_file(self.password_file)
            mode = stat.S_IMODE(os.stat(self.password_file).st_mode)
        except (OSError, ValueError) as exc:
            raise ValueError(str(exc).replace("password_file", "etcd_admin_password_file", 1)) from None
        if mode & 0o077:
            raise ValueError(f"etcd_admin_password_file {self.password_file!r} is readable by others (mode "
                             f"{mode:04o}): it administers every etcd user; `chmod 600 {self.password_file}`")


def open_admin(admin: EtcdAdmin, config: EtcdConfig):
    """A client of the etcd of ``config`` (its endpoints and TLS files) as ``admin``, checked to hold the root role;
    ValueError saying what to fix otherwise."""
    import dataclasses

    from trainwarden.agent.etcd.client import open_etcd
    from trainwarden.agent.etcd.job_records import EtcdAccessDenied, EtcdUnavailable
    from etcd3 import etcdrpc

    config = dataclasses.replace(config, user=admin.user, password=None, password_file=admin.password_file)
    try:
        client = open_etcd(config)
    except EtcdAccessDenied as exc:
        raise ValueError(f"etcd_admin_user {admin.user!r}: {exc}; check etcd_admin_password_file") from None
    except EtcdUnavailable as exc:
        if "not enabled" in str(exc):
            raise ValueError(f"etcd_admin_user {admin.user!r}: etcd at {config.describe()} has authentication off, "
                             "so a launcher's own user would confine nothing: enable it (`etcdctl auth enable`, "
                             "deploy/etcd/roles.sh) or leave out etcd_admin_user") from None
        raise
    try:
        client.authstub.RoleList(etcdrpc.AuthRoleListRequest(), client.timeout, credentials=client.call_credentials,
                                 metadata=client.metadata)
    except Exception as exc:
        client.close()
        raise ValueError(f"etcd_admin_user {admin.user!r} cannot administer users ({describe_etcd_error(exc)}): "
                         f"grant it the root role (`etcdctl user grant-role {admin.user} root`)") from None
    return client


def shared_credential_note(flags: list[str]) -> str:
    """What the daemon says once at start when it has no admin credential: who can act as an agent."""
    named = [f for f in flags if f.startswith("--") and f != "--insecure-etcd"]
    given = "the agents' etcd credential (" + " ".join(named) + ")" if named \
        else "no etcd credential (etcd has no authentication here: anyone who reaches it writes anything)"
    return (f"the launchers of submitted jobs get {given}: a job's user could act as an agent (submit jobs as "
            "anyone, write other jobs' rendezvous). Give each launcher an etcd user of its own with etcd_admin_user "
            "and etcd_admin_password_file (--etcd-admin-user, --etcd-admin-password-file; docs/OPERATIONS.md)")


class JobEtcdIdentities:
    """Grants, revokes and sweeps the launchers' etcd users of one node (module docstring)."""

    def __init__(self, admin_client, *, node: str, state_home: Path, launcher_args: list[str],
                 prefix: str = DEFAULT_PREFIX) -> None:
        """``launcher_args``: the etcd flags every launcher gets besides its user (the CA, ``--insecure-etcd``)."""
        self._client, self._node, self._prefix = admin_client, node, prefix
        self._home = Path(state_home)
        self._base = self._home / "daemon" / CREDENTIALS_DIR
        self._args = list(launcher_args)
        self._pending: set[tuple[str, int]] = set()  # revocations that failed: tried again each round

    def close(self) -> None:
        self._client.close()

    def grant(self, job: str, generation: int, uid: int, gid: int) -> list[str]:
        """The etcd flags of the launcher of ``job``'s ``generation``, run as ``uid``:``gid``: a new user of its own
        and its password file. ``JobIdentityError`` when etcd does not make the user."""
        password = secrets.token_urlsafe(32)
        try:
            revoke_job_user(self._client, job, generation, node=self._node)  # a killed daemon's, if any
            path = self._write(job, password, uid, gid)
            name = grant_job_user(self._client, job, generation, password, node=self._node, prefix=self._prefix)
        except Exception as exc:
            self._remove_dir(job)
            raise JobIdentityError(f"cannot make the etcd user of job {job} generation {generation}: "
                                   f"{describe_etcd_error(exc)}") from exc
        self._pending.discard((job, generation))
        return [*self._args, "--etcd-user", name, "--etcd-password-file", str(path)]

    def revoke(self, job: str, generation: int) -> None:
        """Delete the user of ``job``'s ``generation`` and its password file (a failure is tried again by
        ``retry``)."""
        self._remove_dir(job)
        try:
            revoke_job_user(self._client, job, generation, node=self._node)
            self._pending.discard((job, generation))
        except Exception as exc:
            if (job, generation) not in self._pending:
                logger.warning("cannot delete the etcd user %s (%s); trying again each round",
                               job_user_name(job, generation, self._node), describe_etcd_error(exc))
            self._pending.add((job, generation))

    def retry(self) -> None:
        """Revocations that failed, once more."""
        for job, generation in sorted(self._pending):
            self.revoke(job, generation)

    def sweep(self, keep: dict[str, int]) -> None:
        """Remove this node's job users and password directories except those of ``keep`` (job -> generation of
        the launchers the daemon adopted)."""
        try:
            names = job_user_names(self._client, self._node)
        except Exception as exc:
            logger.warning("cannot list the launchers' etcd users (%s); stale ones stay until a later start",
                           describe_etcd_error(exc))
            names = set()
        for name in sorted(names):
            job, generation, _ = parse_job_user_name(name)
            if keep.get(job) != generation:
                logger.info("removing the etcd user %s: this node runs no launcher of it", name)
                self.revoke(job, generation)
        if self._base.is_dir():
            for entry in sorted(os.listdir(self._base)):
                if entry not in keep:
                    self._remove_dir(entry)

    # ---- the password file ------------------------------------------------------------------------------

    def _open_base(self) -> int:
        """``daemon/credentials`` (root's, 0711), made if missing, opened without following a link."""
        self._base.mkdir(mode=0o711, parents=True, exist_ok=True)
        fd = os.open(self._base, _DIR)
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            os.close(fd)
            raise PermissionError(f"{self._base} must be a directory of uid {os.geteuid()}; remove it and start "
                                  "the daemon again")
        os.fchmod(fd, 0o711)  # others may pass through to their own directory, not list or write
        return fd

    def _write(self, job: str, password: str, uid: int, gid: int) -> Path:
        base = self._open_base()
        try:
            shutil.rmtree(job, dir_fd=base, ignore_errors=True)  # a killed daemon's: links in it are not followed
            os.mkdir(job, 0o700, dir_fd=base)
            jfd = os.open(job, _DIR, dir_fd=base)
            try:
                fd = os.open(PASSWORD_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o600, dir_fd=jfd)
                with os.fdopen(fd, "w") as f:
                    f.write(password + "\n")
                    os.fchown(f.fileno(), uid, gid)
                os.fchown(jfd, uid, gid)
            finally:
                os.close(jfd)
        finally:
            os.close(base)
        return self._base / job / PASSWORD_NAME

    def _remove_dir(self, job: str) -> None:
        try:
            base = self._open_base()
        except OSError:
            return
        try:
            shutil.rmtree(job, dir_fd=base, ignore_errors=True)
        finally:
            os.close(base)

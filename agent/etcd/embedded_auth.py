"""The root user of an embedded etcd: a random password only the run's user can read, set before any port opens.

Every local user can read an embedded etcd's port in ``/proc/PID/cmdline`` (issue 44, item 5: a second uid wrote a
running job's keys). So ``EmbeddedEtcd(auth_dir=...)`` turns etcd's authentication on, and the first start does it
where nobody else can reach: etcd listens on a unix socket in ``auth_dir`` (0700, the run's user's) and nothing else,
``bootstrap_root`` adds the user ``root`` with a random password, grants it the ``root`` role and enables auth; etcd
is stopped and started again on its loopback TCP port with auth already on, so no request without the password is
ever served on a port others can reach. The password is written 0600 in ``auth_dir`` before etcd starts; every
client of the run reads it from there (``EtcdSecurity(user="root", password_file=...)``: the launcher, torchrun's
rendezvous, ``trainwarden status --etcd``).

Two etcd flags go with it: ``--auth-token-ttl`` a year, because python3-etcd3 authenticates once per client and never
again (a simple token left unused for etcd's default five minutes would fail every later call of a quiet client),
and ``--bcrypt-cost 4`` (etcd's minimum), because the password is 256 random bits: a guess costs nothing less than
the key space, and each client's first call pays bcrypt once.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

import grpc
from etcd3 import etcdrpc

__all__ = ["AUTH_ARGS", "BOOTSTRAP_SOCKET", "PASSWORD_FILE", "PEER_SOCKET", "ROOT_USER", "bootstrap_root", "private_dir",
           "write_password"]

ROOT_USER = "root"
PASSWORD_FILE = "etcd-root.password"
"""The root user's password, in ``auth_dir``."""
BOOTSTRAP_SOCKET = "bootstrap:0"
"""etcd's unix-socket URL wants ``host:port``: ``unix://bootstrap:0`` is the file ``bootstrap:0`` in etcd's working
directory (``auth_dir``), where the first start listens while it has no auth yet."""
PEER_SOCKET = "peer:0"
"""The member's peer URL, ``unix://peer:0`` in ``auth_dir``: a single member never dials a peer, and a peer port on
TCP would let any local user send raft messages to the only member."""
AUTH_ARGS = ("--auth-token", "simple", "--auth-token-ttl", str(365 * 24 * 3600), "--bcrypt-cost", "4")


def private_dir(path: str | os.PathLike) -> Path:
    """``path`` as a directory only this user can enter (made 0700 when missing); ValueError when it belongs to
    another user or is a link."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise ValueError(f"{path} must be a directory of uid {os.geteuid()} (not a link) to hold etcd's password; "
                         "remove it or choose another")
    os.chmod(path, 0o700)
    return path


def write_password(auth_dir: Path) -> str:
    """A new random password, written 0600 to ``auth_dir/PASSWORD_FILE`` (replacing one a killed run left)."""
    password = secrets.token_urlsafe(32)
    path = auth_dir / PASSWORD_FILE
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    return password


def bootstrap_root(target: str, password: str, *, timeout: float) -> None:
    """On the etcd at gRPC ``target`` (``unix:/abs/path``): add ``root`` with ``password``, grant it the root role,
    enable auth. Raises ``grpc.RpcError``/``grpc.FutureTimeoutError`` when etcd does not answer in ``timeout``."""
    from trainwarden.agent.etcd.client import GRPC_OPTIONS  # a socket not there yet is retried in 0.1 s, not 1 s

    with grpc.insecure_channel(target, options=GRPC_OPTIONS) as channel:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        auth = etcdrpc.AuthStub(channel)
        auth.UserAdd(etcdrpc.AuthUserAddRequest(name=ROOT_USER, password=password), timeout=timeout,
                     wait_for_ready=True)
        auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user=ROOT_USER, role="root"), timeout=timeout)
        auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=timeout)

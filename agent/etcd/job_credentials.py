"""An etcd user confined to one job's keys (issue 44, item 8): the building block of the launchers' credential.

A daemon-run launcher held the agents' certificate, so any job's user could write ``jobs/`` (submit as anyone) and
every other job's rendezvous. ``grant_job_user`` makes an etcd user and a role of the same name for one job,
generation and node (each node's daemon grants and revokes its own launcher's), whose permissions are the job's
keys only (agent/etcd/keys.py):

* readwrite on ``rdzv/<job>/`` (its rendezvous: torch's state, the c10d store, the native rounds, ``closed``);
* readwrite on ``jobs/<job>/`` except ``spec``, ``control`` and ``autoresume/``, which it may read only
  (``READ_ONLY_PARTS``): the spec names the user the daemon starts the job as, so a launcher that rewrote it would
  choose who its next generation runs as; ``control`` holds an operator's stop, which a launcher could otherwise
  delete to run on; ``autoresume/`` is the webhook's once-only record. It writes its job's ``state`` (its phases);
  a stop request holds whatever generation that state is made to say (``JobView.stop_requested``).
* read on ``<prefix>/_probe``, the key every client reads once to learn that etcd serves it (agent/etcd/job_records.py
  ``connect``; nobody writes it).

``revoke_job_user`` deletes both; ``job_user_names`` lists a node's (a daemon sweeps those of jobs it no longer runs).
The caller needs etcd's root role (user and role administration). The node daemon uses them through
agent/node/job_etcd_identity.py.
"""

from __future__ import annotations

from etcd3 import etcdrpc
from etcd3.etcdrpc import auth_pb2

from trainwarden.agent.etcd.keys import DEFAULT_PREFIX, PROBE_KEY, job_key, rdzv_key

__all__ = ["JOB_USER_PREFIX", "READ_ONLY_PARTS", "grant_job_user", "job_permissions", "job_user_name", "job_user_names",
           "parse_job_user_name", "revoke_job_user"]

JOB_USER_PREFIX = "trainwarden-job-"


def job_user_name(job: str, generation: int, node: str) -> str:
    """The etcd user (and role) of the launcher of ``job``'s ``generation`` on ``node`` (neither a job nor a node
    name holds '@')."""
    return f"{JOB_USER_PREFIX}{job}-{generation}@{node}"


def parse_job_user_name(name: str) -> tuple[str, int, str] | None:
    """``(job, generation, node)`` of a ``job_user_name``; None for any other name."""
    if not name.startswith(JOB_USER_PREFIX):
        return None
    rest, _, node = name[len(JOB_USER_PREFIX):].rpartition("@")
    job, _, generation = rest.rpartition("-")
    if not (job and node and generation.isdigit()):
        return None
    return job, int(generation), node


def _prefix_end(key: str) -> str:
    """The end of the key range of every key starting with ``key`` (its last byte plus one; ``key`` ends in '/')."""
    return key[:-1] + chr(ord(key[-1]) + 1)


READ_ONLY_PARTS = ("autoresume/", "control", "spec")
"""What a launcher reads under ``jobs/<job>/`` but may not write (sorted; a part ending in '/' is a prefix): the
spec names the user the daemon starts the job as; ``control`` holds an operator's stop (a launcher that deleted it
would run on); ``autoresume/`` the once-only record of each alert's resume (the webhook's)."""


def job_permissions(job: str, *, prefix: str = DEFAULT_PREFIX) -> list[auth_pb2.Permission]:
    """The key ranges of ``job``'s role (module docstring)."""
    rdzv, jobs = rdzv_key(job, prefix=prefix) + "/", job_key(job, prefix=prefix) + "/"
    rw, read = auth_pb2.Permission.READWRITE, auth_pb2.Permission.READ
    probe = prefix.rstrip("/") + "/" + PROBE_KEY
    grants = [auth_pb2.Permission(permType=rw, key=rdzv.encode(), range_end=_prefix_end(rdzv).encode()),
              auth_pb2.Permission(permType=read, key=jobs.encode(), range_end=_prefix_end(jobs).encode())]
    start = jobs  # readwrite on the gaps between the read-only parts
    for part in READ_ONLY_PARTS:
        key = jobs + part
        grants.append(auth_pb2.Permission(permType=rw, key=start.encode(), range_end=key.encode()))
        start = _prefix_end(key) if part.endswith("/") else key + "\0"
    grants.append(auth_pb2.Permission(permType=rw, key=start.encode(), range_end=_prefix_end(jobs).encode()))
    grants.append(auth_pb2.Permission(permType=read, key=probe.encode()))
    return grants


def _call(client, method: str, request):
    return getattr(client.authstub, method)(request, client.timeout, credentials=client.call_credentials,
                                            metadata=client.metadata)


def grant_job_user(client, job: str, generation: int, password: str, *, node: str,
                   prefix: str = DEFAULT_PREFIX) -> str:
    """Make the user and role of ``job``'s ``generation`` on ``node`` with ``password``; the user's name. ``client``
    holds etcd's root role. Raises the etcd3/gRPC error when one exists already (revoke it first)."""
    name = job_user_name(job, generation, node)
    _call(client, "RoleAdd", etcdrpc.AuthRoleAddRequest(name=name))
    for perm in job_permissions(job, prefix=prefix):
        _call(client, "RoleGrantPermission", etcdrpc.AuthRoleGrantPermissionRequest(name=name, perm=perm))
    _call(client, "UserAdd", etcdrpc.AuthUserAddRequest(name=name, password=password))
    _call(client, "UserGrantRole", etcdrpc.AuthUserGrantRoleRequest(user=name, role=name))
    return name


def revoke_job_user(client, job: str, generation: int, *, node: str) -> None:
    """Delete the user and role of ``job``'s ``generation`` on ``node`` (what is already gone is skipped)."""
    import grpc

    name = job_user_name(job, generation, node)
    for method, request in (("UserDelete", etcdrpc.AuthUserDeleteRequest(name=name)),
                            ("RoleDelete", etcdrpc.AuthRoleDeleteRequest(role=name))):
        try:
            _call(client, method, request)
        except grpc.RpcError as exc:
            if "not found" not in (exc.details() or ""):
                raise


def job_user_names(client, node: str) -> set[str]:
    """The job users and roles of ``node`` that etcd holds (two list calls)."""
    users = _call(client, "UserList", etcdrpc.AuthUserListRequest()).users
    roles = _call(client, "RoleList", etcdrpc.AuthRoleListRequest()).roles
    return {name for name in (*users, *roles) if (parsed := parse_job_user_name(name)) and parsed[2] == node}

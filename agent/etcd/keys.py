"""The etcd key layout (DESIGN.md's contract), built in one place.

Every trainwarden key lives under one prefix, ``/trainwarden/v1`` by default; a job's keys under
``<prefix>/jobs/<job>/``: ``spec``, ``state``, ``checkpoint``, ``incidents/<id>``, ``exclude/<node>``, ...; its
rendezvous keys under ``<prefix>/rdzv/<job>/`` (``rdzv_key``): ``state`` (torch's dynamic rendezvous, pickled),
``store/...`` (the c10d store), ``rounds/<round>/...`` (the etcd-native round: ``nodes/<node>``, ``close/by``,
``close/members``; see ``rendezvous_key``) and ``closed``. They are apart from ``jobs/`` so that etcd roles can
let submitters write ``jobs/`` and only agents and launchers write what a launcher unpickles
(deploy/etcd/roles.sh; docs/SECURITY.md). See docs/ARCHITECTURE.md, "etcd keys".
"""

from __future__ import annotations

__all__ = ["DEFAULT_PREFIX", "PROBE_KEY", "ROUND_DIGITS", "job_key", "rdzv_key", "rendezvous_key"]

DEFAULT_PREFIX = "/trainwarden/v1"

PROBE_KEY = "_probe"
"""``<prefix>/_probe``: the key a client reads once to learn that etcd serves it (never written)."""

ROUND_DIGITS = 8
"""A native rendezvous round's number is zero-padded to this many digits, so the keys' text order is the rounds'."""


def job_key(job: str, *parts: str, prefix: str = DEFAULT_PREFIX) -> str:
    """``<prefix>/jobs/<job>/<parts...>``; with no parts, the job's own prefix (no trailing slash)."""
    return "/".join([prefix.rstrip("/"), "jobs", job, *parts])


def rdzv_key(job: str, *parts: str, prefix: str = DEFAULT_PREFIX) -> str:
    """``<prefix>/rdzv/<job>/<parts...>``: a job's rendezvous keys; with no parts, their prefix (no trailing
    slash)."""
    return "/".join([prefix.rstrip("/"), "rdzv", job, *parts])


def rendezvous_key(job: str, round_: int | None = None, *parts: str, prefix: str = DEFAULT_PREFIX) -> str:
    """``<prefix>/rdzv/<job>/rounds/<round>/<parts...>`` of the etcd-native rendezvous
    (agent/rendezvous/native.py); with no round, the prefix of every round (trailing slash), with a round and
    no parts, that round's prefix (trailing slash)."""
    if round_ is None:
        return rdzv_key(job, "rounds", prefix=prefix) + "/"
    if round_ < 0:
        raise ValueError(f"rendezvous round {round_} is negative")
    base = rdzv_key(job, "rounds", f"{round_:0{ROUND_DIGITS}d}", prefix=prefix)
    return "/".join([base, *parts]) if parts else base + "/"

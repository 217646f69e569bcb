"""The etcd key layout (DESIGN.md's contract), built in one place.

Every trainwarden key lives under one prefix, ``/trainwarden/v1`` by default; a job's keys under
``<prefix>/jobs/<job>/``: ``spec``, ``state``, ``rdzv``, ``store/...``, ``checkpoint``, ``incidents/<id>``
and ``exclude/<node>`` (see docs/ARCHITECTURE.md, "etcd keys").
"""

from __future__ import annotations

__all__ = ["DEFAULT_PREFIX", "job_key"]

DEFAULT_PREFIX = "/trainwarden/v1"


def job_key(job: str, *parts: str, prefix: str = DEFAULT_PREFIX) -> str:
    """``<prefix>/jobs/<job>/<parts...>``; with no parts, the job's own prefix (no trailing slash)."""
    return "/".join([prefix.rstrip("/"), "jobs", job, *parts])

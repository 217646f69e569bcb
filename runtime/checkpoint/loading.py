"""Loading a checkpoint on every rank (the Checkpointer's restore, runtime/checkpoint/checkpointer.py): DCP's load
through the allow-listed metadata reader, tried again after a failure on any rank (every rank gathers every rank's
result, so all of them decide alike), and the RNG states from each rank's sidecar file."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Mapping

import torch.distributed.checkpoint as dcp

from trainwarden.agent.shared import checkpoint_layout as store
from trainwarden.runtime.checkpoint.errors import SAVE_LOAD_ERRORS, describe, is_read_error
from trainwarden.runtime.checkpoint.group import GroupCollectives
from trainwarden.runtime.checkpoint.metadata_reader import AllowListReader
from trainwarden.runtime.checkpoint.state import RNGState, load_sidecar, put_back

__all__ = ["load_state", "load_with_retries", "restore_rng"]

logger = logging.getLogger("trainwarden.runtime.checkpoint.checkpointer")  # the restore's log, as before the split


def load_with_retries(group: GroupCollectives, path: Path, state: Mapping[str, Any], attempts: int, delay: float, *,
                      rank: int) -> tuple[str, bool]:
    """("", False) once every rank loaded `path`; else what failed after `attempts` tries that all failed,
    and whether the last failure was a read error (an OSError on some rank) rather than bad content."""
    detail, read_error = "", False
    for attempt in range(1, max(1, attempts) + 1):
        results = group.gather(load_state(path, state, pg=group.pg, distributed=group.distributed))
        failed = {r: e for r, (e, _) in enumerate(results) if e}
        if not failed:
            return "", False
        read_error = any(is_read for _, is_read in results)
        by_error: dict[str, list[int]] = {}
        for r, e in sorted(failed.items()):
            by_error.setdefault(e, []).append(r)
        detail = "; ".join(f"ranks {rs}: {e}" for e, rs in by_error.items())
        if attempt < attempts:
            if rank == 0:  # every rank gathered the same results: one of them says it
                logger.warning("checkpoint %s failed to load (attempt %d of %d: %s); trying again in %.0f s",
                               path, attempt, attempts, detail, delay * attempt)
            group.barrier()
            time.sleep(delay * attempt)
    if rank == 0:
        logger.error("checkpoint %s failed to load on all %d attempts (%s)%s", path, attempts, detail,
                     " (a read error: the storage, not the checkpoint)" if read_error else
                     ". If the model or optimizer definition changed since it was saved, that is the cause.",
                     extra={"event": "checkpoint_unloadable"})
    return detail, read_error


def load_state(path: Path, state: Mapping[str, Any], *, pg, distributed: bool) -> tuple[str, bool]:
    """This rank's DCP load of ``state`` (its RNG entries aside) from ``path``: ("", False) when loaded; else (what
    failed, whether it was a read error)."""
    dcp_state = {k: v for k, v in state.items() if not isinstance(v, RNGState)}
    try:
        dcp.load(dcp_state, storage_reader=AllowListReader(path), process_group=pg, no_dist=not distributed)
    except SAVE_LOAD_ERRORS as exc:
        return describe(exc), is_read_error(exc)
    for name, value in dcp_state.items():
        if not hasattr(value, "state_dict"):
            put_back(state, name, value)  # DCP hands back a new list or number for a plain entry
    return "", False


def restore_rng(path: Path, state: Mapping[str, Any], *, rank: int, world_size: int) -> None:
    """This rank's RNG states from its sidecar in ``path``, when the checkpoint was saved at this world size."""
    entries = {k: v for k, v in state.items() if isinstance(v, RNGState)}
    if not entries:
        return
    try:
        saved = (store.read_manifest(path) or {}).get("world_size")
    except (OSError, ValueError) as exc:
        saved = f"unknown ({exc})"
    if saved != world_size:
        logger.warning("checkpoint %s was saved at world size %s, now %d: RNG states not restored, the "
                       "generators keep their current seeds", path, saved, world_size)
        return
    load_sidecar(path / store.rng_sidecar_name(rank), entries)

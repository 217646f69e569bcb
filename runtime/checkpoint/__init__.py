"""The runtime's checkpoints: disk saves with a commit protocol, per-step memory snapshots, and restore from either.

The package's front is ``Checkpointer`` (``from trainwarden.runtime.checkpoint import Checkpointer``); the rest
are its parts, each a module:

- ``checkpointer``: ``Checkpointer``, the disk side: asynchronous sharded DCP saves, commit, retention, restore;
  ``writer``: its DCP writer and stager.
- ``memory``: the Checkpointer's memory side (snapshot every step, the copy on the next node, restore from them).
- ``memory_snapshot``, ``snapshot_file``, ``memory_peer``, ``memory_reshard``, ``memory_sums``: one rank's
  snapshots, their file format, the copy sent to the next node, a restore into another world size, and the
  snapshots' checksums.
- ``restore_plan``, ``resume_evidence``: which checkpoint a restore tries first, and what the job knows of its commits.
- ``state``, ``state_dict_reader``, ``metadata_reader``: state-dict entries (RNG, model), reading a checkpoint's
  tensors and its metadata without unpickling anything but DCP's own classes.
- ``sums``, ``errors``, ``save_failures``: a disk checkpoint's checksums, what a failed DCP call says, and a
  streak of failed saves (a full disk) reported once.

The front is imported on first use, so importing one part (``errors``, ``metadata_reader``) does not import
the whole Checkpointer.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "CheckpointSaveError",
    "CheckpointUnloadableError",
    "Checkpointer",
    "ModelState",
    "RNGState",
    "find_complete",
    "validate",
]


_PARTS = frozenset({
    "checkpointer", "errors", "memory", "memory_peer", "memory_reshard", "memory_snapshot", "memory_sums",
    "metadata_reader", "restore_plan", "resume_evidence", "save_failures", "snapshot_file", "state", "state_dict_reader",
    "sums", "writer",
})


def __getattr__(name: str) -> Any:
    # Everything the Checkpointer's module defines is reachable from the package, as it was from the module
    # the package replaced (runtime/checkpoint.py).
    if name in _PARTS:
        return importlib.import_module(f".{name}", __name__)
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(importlib.import_module(".checkpointer", __name__), name)

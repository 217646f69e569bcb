"""DCP's ``FileSystemReader`` with its ``.metadata`` read through trainwarden's allow-list (issue 44, item 1).

``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle.load``; the workers' restore reads
through ``AllowListReader`` instead, which reads the same file with ``metadata_unpickler.read_regular`` (no link
followed, bounded) and ``load_metadata`` (only DCP's metadata classes), then does what DCP's does after the load
(a ``StorageMeta`` holding this load's id). Everything else (planning, reading tensor data with
``torch.load(weights_only=True)``) is DCP's own. A checkpoint whose metadata names another class fails to load
with ``MetadataRefused``, naming it; ``classify`` has already reported such a checkpoint as unreadable.

What this does not cover: DCP's default load planner reads a non-tensor entry (``BYTE_IO``: a number, a string,
an object in the state dict) with ``torch.load(weights_only=False)``. The workers run as the job's user and read
the job's own checkpoint directory, so that is the user's own code; root never loads checkpoint data.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from trainwarden.agent.shared.metadata_unpickler import MAX_METADATA_BYTES, load_metadata
from trainwarden.agent.shared.regular_file import read_regular

__all__ = ["AllowListReader"]


class AllowListReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` uses the allow-list unpickler (see the module's docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        metadata = load_metadata(read_regular(path, MAX_METADATA_BYTES))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

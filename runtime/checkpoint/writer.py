"""How the Checkpointer writes through DCP: its ``FileSystemWriter`` (``_Writer``: the rank's RNG sidecar, the
manifest and the checksums written where a complete checkpoint needs them) and its stager (``_ReusedStager``: host
buffers kept from one save to the next), and what a rank's files weigh (``_own_bytes``)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Mapping

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from trainwarden.agent.shared import checkpoint_layout as store
from trainwarden.agent.shared import checkpoint_sums
from trainwarden.runtime.checkpoint.state import write_sidecar
from trainwarden.runtime.checkpoint.sums import HashingFileSystem

logger = logging.getLogger("trainwarden.runtime.checkpoint.checkpointer")  # the Checkpointer's lines, one logger


class _Writer(FileSystemWriter):
    """FileSystemWriter that writes trainwarden's per-rank files before its rank enters the plan collective,
    so ``.metadata`` (written after every rank's data) implies they exist."""

    def __init__(self, path: Path, *, step: int, world_size: int, rng: Mapping[str, dict], rank: int):
        super().__init__(path, sync_files=True)
        self._tw_dir = Path(path)
        self._tw_step, self._tw_world, self._tw_rng, self._tw_rank = step, world_size, rng, rank
        self._tw_sums: dict[str, dict] = {}
        self.fs = HashingFileSystem(self._tw_sums)  # each data file hashed as it is written (checkpoint_sums.py)

    def write_data(self, plan, planner):
        """DCP's write, then this rank's sums (``.sums-rank-R.json``): before the gather of write results, so
        before rank 0 writes ``.metadata``."""
        written = super().write_data(plan, planner)
        record = {"algorithm": checkpoint_sums.ALGORITHM, "rank": self._tw_rank, "files": dict(self._tw_sums)}
        store.atomic_write(self._tw_dir / checkpoint_sums.sidecar_name(self._tw_rank), json.dumps(record).encode())
        return written

    def prepare_local_plan(self, plan):
        if self._tw_rank == 0:
            stale = self._tw_dir / store.METADATA_NAME
            if stale.exists():  # left by an earlier save of this step: it would make a torn save look complete
                logger.warning("removing stale %s before re-saving step %d", stale, self._tw_step)
                stale.unlink()
        plan = super().prepare_local_plan(plan)  # creates the directory
        if self._tw_rng:
            write_sidecar(self._tw_dir / store.rng_sidecar_name(self._tw_rank), self._tw_rng)
        if self._tw_rank == 0:
            manifest = {"step": self._tw_step, "world_size": self._tw_world, "rng_keys": sorted(self._tw_rng),
                        "time": time.time()}
            store.atomic_write(self._tw_dir / store.MANIFEST_NAME, json.dumps(manifest).encode())
        return plan


class _ReusedStager(DefaultStager):
    """The Checkpointer's stager: its host buffers (pinned on CUDA) are kept from one save to the next, and
    only the Checkpointer releases them (``release``).

    torch 2.11's ``DefaultStager._stage`` closes its copier after every stage (2.13 leaves that to the
    owner). Closing drops the cached buffers and empties the copier's dispatch table, so on 2.11 every save
    after the first failed with ``KeyError(<class 'type'>)``: seen on an H100 with a 403M-parameter model,
    reproduced on CPU in tests/unit/test_checkpoint_safety.py. The copier's ``close`` is therefore a no-op
    here, and so is the stager's, which some torch versions' ``async_save`` call on a caller's stager."""

    def __init__(self, options: StagingOptions) -> None:
        super().__init__(options)
        copier = self._state_dict_stager
        self._release_copier = copier.close
        copier.close = lambda: None  # the instance attribute shadows the method: 2.11's _stage calls it

    def close(self) -> None:  # a caller other than the Checkpointer: the buffers stay for the next save
        pass

    def release(self) -> None:
        """Drop the buffers and break the copier's reference cycle (its closures hold it)."""
        self._release_copier()
        super().close()


def _own_bytes(path: Path, rank: int) -> int:
    """Bytes of ``rank``'s files in a checkpoint, for the metrics. Another rank may move the directory
    meanwhile (rank 0 sets a fenced checkpoint aside as soon as its commit is refused): what cannot be
    counted is not, and never fails the save."""
    total = 0
    try:
        files = [*path.glob(f"__{rank}_*"), path / store.rng_sidecar_name(rank)]
    except OSError:  # moved between pathlib's is-a-directory check and its scan
        return 0
    for p in files:
        try:
            total += p.stat().st_size
        except OSError:
            pass
    return total

"""The host memory where the workers' per-step snapshots outlive the workers: ``MemoryTier``.

`trainwarden run` makes one private directory in shared memory (``/dev/shm``) for the job on this node and gives
it to the workers (``MEMORY_DIR_ENV``). Each rank writes its snapshot there after every step and reports the file
(checkpoint stage ``snapshot``; runtime/checkpoint/memory_snapshot.py). This class hears those reports and answers the
restoring ranks which of their snapshots it holds (the CheckpointRecord RPC's ``memory_steps``); the ranks agree on
the newest step all of them have (runtime/checkpoint/checkpointer.py), so a restart after a crash or a hang resumes from the step
before the fault, from memory. Each node's agent answers for the files in its own directory only (``held``: of
every rank on the node, for a restore into another world size or numbering, whose ranks exchange the chunks among
themselves: runtime/checkpoint/memory_reshard.py); agents never talk to each other about them.

What it trusts:

- only reports of this run's workers (the telemetry server checks who holds each rank) naming files inside
  its own directory: of the reporting rank, or a copy it received of a rank of another node (``world-N/peer/``,
  runtime/checkpoint/memory_peer.py);
- only what it heard in its own life: the record is in this process, and the directory is this process's
  (scratch-marked with its pid). A run that restarts (the daemon relaunching a launcher, an agent restart)
  starts with no record and removes the directories of runs that are gone, so a snapshot is never used after
  the agent that owned it stopped. Disk stays the durable truth: the runtime never uses a snapshot older than a
  committed disk checkpoint.

A snapshot of another world size is another ``world-N`` directory (a round that shrank or grew); the first
report of a new world size removes the others.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections import deque
from pathlib import Path

from trainwarden.agent.common.scratch import scratch_dir, sweep
from trainwarden.agent.shared.contract import MEMORY_DIR_ENV
from trainwarden.agent.shared.snapshot_layout import KEEP, parse_peer, parse_snapshot

__all__ = ["DEFAULT_ROOT", "ROOT_ENV", "MemoryTier", "start_memory_tier"]

log = logging.getLogger(__name__)

DEFAULT_ROOT = Path("/dev/shm")
ROOT_ENV = "TRAINWARDEN_MEMORY_ROOT"
"""Where `trainwarden run` makes the tier (default ``/dev/shm``): a tmpfs with room for two snapshots of the
node's ranks (a container's /dev/shm is often 64 MiB: mount a larger one, or point this at another tmpfs)."""
PREFIX = "trainwarden-mem-"


class MemoryTier:
    """This run's shared-memory directory for the job's snapshots and what the workers reported of it."""

    def __init__(self, job: str, path: Path) -> None:
        self.job = job
        self.path = path
        self._lock = threading.Lock()
        self._world: int | None = None
        self._steps: dict[int, deque[int]] = {}  # rank -> its newest reported steps (what its files hold)
        self._copies: dict[int, deque[int]] = {}  # a rank of another node -> the steps of its copies here
        self.reports = 0

    @classmethod
    def open(cls, job: str, *, root: Path | None = None) -> "MemoryTier | None":
        """A new tier under ``root`` (default: ``$TRAINWARDEN_MEMORY_ROOT`` or ``/dev/shm``), removing what runs
        that are gone left there; None, with the reason logged, when ``root`` cannot hold one."""
        if root is None:
            root = Path(os.environ.get(ROOT_ENV) or DEFAULT_ROOT)
        try:
            sweep(PREFIX, root=root)
            path = scratch_dir(f"{PREFIX}{job}-", root=root)
        except OSError as exc:
            log.warning("no memory snapshots for job %s: cannot make a directory in %s (%s); restarts restore from "
                        "the disk checkpoints", job, root, exc)
            return None
        return cls(job, path)

    def env(self) -> dict[str, str]:
        """What the workers need to find it."""
        return {MEMORY_DIR_ENV: str(self.path)}

    # ---- telemetry listener (the agent's reader thread: quick, never blocks) ------------------------------

    def on_step(self, job: str, rank: int, pid: int, index: int, start_unix: float, duration_s: float) -> None:
        pass

    def on_checkpoint(self, job: str, rank: int, stage: str, step: int, path: str, nbytes: int,
                      detail: str = "", seconds: float = 0.0) -> None:
        if stage != "snapshot" or job != self.job:
            return
        parsed, copy = parse_snapshot(path), parse_peer(path)
        if copy is not None and Path(path).parent.parent.parent == self.path and copy[2] == step and copy[1] != rank:
            world, owner = copy[0], copy[1]  # a copy of another node's rank, received by this node's `rank`
        elif parsed is not None and Path(path).parent.parent == self.path and parsed[1] == rank and parsed[2] == step:
            world, owner = parsed[0], None
        else:
            log.warning("job %s rank %d reported a snapshot at %r, not a file of its own nor a copy it received in "
                        "%s: ignored", job, rank, path[:300], self.path)
            return
        stale = []
        with self._lock:
            if world != self._world:
                stale = [p for p in self.path.glob("world-*") if p.name != f"world-{world}"]
                self._world, self._steps, self._copies = world, {}, {}
            record = self._steps if owner is None else self._copies
            steps = record.setdefault(rank if owner is None else owner, deque(maxlen=KEEP))
            if not steps or step > steps[-1]:
                steps.append(step)
            self.reports += 1
        for old in stale:  # the workers of that world size are gone
            shutil.rmtree(old, ignore_errors=True)

    # ---- the restoring rank's question ---------------------------------------------------------------------

    def steps(self, job: str, world_size: int, rank: int) -> list[int]:
        """The steps ``rank`` reported a snapshot of at ``world_size`` and still keeps, newest first."""
        if job != self.job:
            return []
        with self._lock:
            if world_size != self._world:
                return []
            return sorted(self._steps.get(rank, ()), reverse=True)

    def held(self, job: str) -> list[tuple[int, int, int]]:
        """(world size, rank, step) of every snapshot file this agent heard reported and still keeps: a restore
        into another world size, or with the ranks numbered anew, reads them (runtime/checkpoint/memory_reshard.py)."""
        if job != self.job:
            return []
        with self._lock:
            if self._world is None:
                return []
            return [(self._world, rank, step) for record in (self._steps, self._copies)
                    for rank, steps in sorted(record.items()) for step in steps]

    def close(self) -> None:
        """Remove the directory and every snapshot in it (the run is over)."""
        shutil.rmtree(self.path, ignore_errors=True)


def start_memory_tier(job: str, agent, *, enabled: bool, cleanup, out) -> "MemoryTier | None":
    """`trainwarden run`'s tier for ``job`` with its in-process ``agent`` (None: it keeps none, said in one line)."""
    if not enabled or agent is None:
        print("trainwarden: memory snapshots: off (--no-memory-snapshots); restarts restore from the disk "
              "checkpoints", file=out, flush=True)
        return None
    tier = MemoryTier.open(job)
    if tier is None:
        return None
    cleanup.callback(tier.close)
    agent.job_telemetry.add_listener(tier)
    agent.server.memory_steps = tier.steps
    agent.server.memory_held = tier.held
    print(f"trainwarden: memory snapshots in {tier.path}: a job that checkpoints with trainwarden's Checkpointer "
          "and snapshots every step restarts from the step before a fault (--no-memory-snapshots turns this off)",
          file=out, flush=True)
    return tier

"""Sharded asynchronous checkpoints with a commit protocol: ``Checkpointer``.

This module is the disk side. The memory side (per-step snapshots, their copy on the next node, and a restore
from them, tried before the disk) is the mixin in runtime/checkpoint/memory.py; what a failed DCP call says is
runtime/checkpoint/errors.py.

Save (``Checkpointer.save``):

1. Wait for the previous save (one in flight at a time).
2. Stage: ``dcp.async_save`` with a ``DefaultStager`` owned by the Checkpointer copies the state into host
   buffers that are cached per source storage and reused by every later save (pinned where CUDA is
   available). This copy is the only part the training step waits for (``last_stall_seconds``).
3. DCP's thread executor plans and writes in the background, with its collectives on a dedicated gloo
   process group created once in the constructor, so they never interleave with training collectives.
   Our ``FileSystemWriter`` subclass writes, before its rank enters DCP's planning collective, the rank's RNG
   sidecar and, on the coordinator, the manifest (and removes a stale ``.metadata`` left in the directory).
4. A committer thread waits for the upload; on rank 0 it validates the directory (``checkpoint_layout``),
   publishes the atomic ``latest`` pointer, calls ``on_commit(CheckpointInfo)`` and applies retention.

Restore (``Checkpointer.restore``): rank 0 plans (runtime/checkpoint/restore_plan.py: the ``step-*`` directories newest
first, weighed against what the job knows of its own checkpoints; one that cannot be read is looked at again
with backoff and, if it still cannot be read, stops the job with ``CheckpointReadError`` and nothing set aside:
a read error is not corruption). The plan is broadcast; every rank tries to load the first candidate, and the ranks
agree with an all_gather of their errors: a failure is retried (``load_attempts``) and only one that repeats,
with bad content rather than a read error, moves every rank on to the next candidate together, while rank 0
sets the failed one aside (``step-N.unloadable``, with QUARANTINE.json saying why). Restore never deletes,
and ranks never end up on different checkpoints. When nothing loads, a job that has ever committed a
checkpoint stops (``CheckpointUnloadableError``) unless ``allow_fresh_start=True``; each refusal is reported
to the agent as ``resume_blocked``. Only a job with no evidence of any commit starts fresh (None), unless
``require=True``.

RNG state is per rank and cannot go through DCP (a key saved by 8 ranks does not exist for rank 8 of 16):
``RNGState`` entries of the state dict are taken out of the DCP state and written as ``rng-rank<R>.pt``
sidecars. They restore exactly at the same world size; at another world size they are skipped with a
warning and the run keeps its freshly seeded generators.

Failed saves never raise into the training loop: they are logged with the path, counted in
``failed_saves`` and kept in ``last_error``; the previous committed checkpoint stays the latest.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from trainwarden.agent.shared import checkpoint_aside as asides
from trainwarden.agent.shared import checkpoint_layout as store
from trainwarden.agent.shared import checkpoint_sums
from trainwarden.runtime.checkpoint.group import GroupCollectives
from trainwarden.runtime.peer_failure import peer_failure
from trainwarden.agent.shared.checkpoint_layout import (
    CheckpointError,
    CheckpointInfo,
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointUnloadableError,
    CheckpointSaveError,
    find_complete,
    validate,
)
from trainwarden.runtime.checkpoint.errors import SAVE_LOAD_ERRORS, describe
from trainwarden.runtime.checkpoint.memory import MemoryRestore
from trainwarden.runtime.checkpoint.loading import load_with_retries, restore_rng
from trainwarden.runtime.checkpoint.state import ModelState, RNGState
from trainwarden.runtime.checkpoint.restore_plan import RestorePlan, plan_restore, read_backoff_from_env
from trainwarden.runtime.checkpoint.sums import verify_share
from trainwarden.runtime.checkpoint.save_failures import SaveFailures
from trainwarden.runtime.checkpoint.writer import _ReusedStager, _Writer, _own_bytes
from trainwarden.runtime.session import current as current_session

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

logger = logging.getLogger(__name__)

class Checkpointer(MemoryRestore):
    """Saves and restores sharded checkpoints under one directory. Collective: every rank constructs it,
    calls ``save``/``restore`` at the same steps and closes it.

    ``process_group``: the group DCP's collectives run on; by default one gloo group over the world,
    created (collectively) here and destroyed by ``close``. One given must span every rank and must not
    carry training collectives. The staging buffers are reused by the next save, which is why that save
    first waits for this one (one save in flight). Without ``torch.distributed`` initialized it
    works single-process. ``on_commit`` runs on rank 0 in a background thread after a checkpoint is
    complete and the pointer is written (the next ``save`` does not wait for it); exceptions it raises are
    logged, never propagated.
    """

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True,
                 process_group: dist.ProcessGroup | None = None,
                 on_commit: Callable[[CheckpointInfo], None] | None = None,
                 session=None, before_save: Callable[[int], None] | None = None,
                 read_backoff_s: tuple[float, ...] | None = None,
                 memory_dir: str | Path | None | bool = True, ranks_per_node: int | None = None,
                 after_snapshot: Callable[[int, str], None] | None = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (the newest complete checkpoint is never deleted), got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.async_save = async_save
        self._on_commit = on_commit
        self._events = session  # reports stages to the node agent; None: the process's current runtime session
        self._before_save = before_save  # e.g. the fault injector's slow_save
        self.read_backoff_s = read_backoff_s if read_backoff_s is not None else read_backoff_from_env()
        """Pauses between looks at checkpoints that cannot be read yet, before restore gives up and stops."""
        self._distributed = dist.is_available() and dist.is_initialized()
        self._owns_pg = False
        if self._distributed and process_group is None:
            process_group = dist.new_group(backend="gloo")
            self._owns_pg = True
        self._pg = process_group
        self._group = GroupCollectives(process_group, distributed=self._distributed)
        self.rank = dist.get_rank() if self._distributed else 0
        self.world_size = dist.get_world_size() if self._distributed else 1
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
        cuda = torch.cuda.is_available()
        self._stager = _ReusedStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=cuda))
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainwarden-ckpt-commit")
        # on_commit (etcd publishing) and retention (deleting old checkpoints) run here, so the next save,
        # which waits for the previous commit, never waits for a slow etcd or a large rmtree
        self._post_commit = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainwarden-ckpt-after")
        self._inflight: Future | None = None
        self._last_saved_step: int | None = None
        self._closed = False
        self.last_stall_seconds = 0.0
        self.last_save_seconds = 0.0
        self.last_bytes = 0
        self.last_committed: CheckpointInfo | None = None
        self.last_error: BaseException | None = None
        self.failed_saves = 0
        self._save_failures = SaveFailures(self.directory, rank=self.rank)
        self._init_memory(memory_dir, ranks_per_node, after_snapshot)  # after_snapshot: e.g. a snapflip fault

    # -- save -----------------------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Checkpoint ``state`` as ``step``. Blocks for the previous save and the host copy only (unless
        constructed with ``async_save=False``)."""
        if self._closed:
            raise CheckpointError("save() on a closed Checkpointer; create a new one")
        start = time.monotonic()
        self._wait_commit()  # the staging buffers are reused: the previous save must be written first
        if step == self._last_saved_step:  # e.g. an on-demand save at a scheduled step: already written
            logger.info("step %d is already checkpointed; not saving it again", step)
            return
        self._report("save_start", step)  # the watchdog allows a blocking save its own, longer deadline
        if self._before_save is not None:
            self._before_save(step)
        path = store.step_dir(self.directory, step)
        rng = {k: v.state_dict() for k, v in state.items() if isinstance(v, RNGState)}
        dcp_state = {k: v for k, v in state.items() if not isinstance(v, RNGState)}
        writer = _Writer(path, step=step, world_size=self.world_size, rng=rng, rank=self.rank)
        try:
            response = dcp.async_save(dcp_state, storage_writer=writer, process_group=self._pg,
                                      async_checkpointer_type=AsyncCheckpointerType.THREAD,
                                      async_stager=self._stager, no_dist=not self._distributed)
        except SAVE_LOAD_ERRORS as exc:
            self._record_failure(step, path, exc)
            return
        upload = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
        if isinstance(response, AsyncSaveResponse):
            response.staging_completion.result()
        self.last_stall_seconds = time.monotonic() - start
        self._inflight = self._committer.submit(self._finish, step, path, upload, start)
        if not self.async_save:
            self.wait()
            self.last_stall_seconds = time.monotonic() - start
        self._report("staged", step, seconds=self.last_stall_seconds)

    def wait(self) -> CheckpointInfo | None:
        """Block until the in-flight save (if any) is written and committed, and its ``on_commit`` and
        retention have run. Returns what rank 0 committed (None on other ranks, when there was nothing
        in flight, or when the save failed)."""
        info = self._wait_commit()
        self._post_commit.submit(lambda: None).result()
        return info

    def _wait_commit(self) -> CheckpointInfo | None:
        inflight, self._inflight = self._inflight, None
        return inflight.result() if inflight is not None else None

    def _finish(self, step: int, path: Path, upload: Future, start: float) -> CheckpointInfo | None:
        try:
            upload.result()
        except SAVE_LOAD_ERRORS as exc:
            self._record_failure(step, path, exc)
            return None
        self.last_save_seconds = time.monotonic() - start
        self._last_saved_step = step  # every rank sees the same outcome: DCP's write phase is collective
        self.last_bytes = _own_bytes(path, self.rank)
        # every rank: the steps it took while this write ran are not a hang's measure (agent/watchdog/hang.py)
        self._report("written", step, seconds=self.last_save_seconds, bytes=self.last_bytes)
        if self.rank != 0:
            return None
        try:
            return self._commit(step, path)
        except Exception as exc:
            self._record_failure(step, path, exc)
            return None

    def _commit(self, step: int, path: Path) -> CheckpointInfo | None:
        problems = validate(path)
        if problems:
            raise CheckpointSaveError(f"checkpoint {path} is incomplete after the save finished: "
                                      f"{'; '.join(problems)}")
        info = store.info_for(store.CheckpointStatus(step=step, path=path, problems=()))
        refusal = self._commit_refusal(step, info)
        if refusal is not None:  # a fenced round: its checkpoint must not become the job's state
            self.failed_saves += 1
            target = asides.quarantine(path, state=store.FENCED, reason=refusal)
            logger.error("checkpoint step %d not committed: %s; set aside as %s. The job's latest checkpoint is "
                         "unchanged.", step, refusal, target, extra={"event": "checkpoint_fenced", "step": step})
            # said once a streak, like any failed save (save_failures.py): an etcd without quorum refuses each save
            if self._save_failures.failed(step, path, f"fenced: {refusal}", CheckpointSaveError(refusal),
                                          advice="The next save commits once the node agent can confirm the round."):
                self._report("failed", step, path=str(target), detail=f"fenced: {refusal}"[:1000])
            return None
        # from here on this directory is never an "unfinished save"; the marker records every file's sum
        store.mark_committed(path, step, sums=checkpoint_sums.merge_sidecars(path))
        store.write_latest(self.directory, info)
        self.last_committed = info
        self._save_failures.committed(step)
        logger.info("checkpoint step %d committed: %s (%d bytes, %.3fs stall, %.3fs total)", step, path,
                    info.bytes, self.last_stall_seconds, self.last_save_seconds,
                    extra={"event": "checkpoint_commit", "step": step, "bytes": info.bytes})
        self._report("committed", step, bytes=info.bytes, path=info.path)  # the agent publishes it to etcd
        self._post_commit.submit(self._after_commit, info, path)
        return info

    def _commit_refusal(self, step: int, info: CheckpointInfo) -> str | None:
        """Why this checkpoint may not be published (the node agent's fencing check), or None."""
        session = self._events or current_session()
        ask = getattr(session, "commit_refusal", None)
        if ask is None:
            return None
        try:
            return ask(step, info.path, info.bytes)
        except Exception:
            logger.warning("could not ask the node agent whether step %d may be committed; committing", step,
                           exc_info=True)
            return None

    def _after_commit(self, info: CheckpointInfo, path: Path) -> None:
        if self._on_commit is not None:
            try:
                self._on_commit(info)
            except Exception:
                logger.exception("on_commit callback failed for %s (the checkpoint itself is committed)", path)
        try:
            self._apply_retention()
        except Exception:
            logger.exception("retention after %s failed; old checkpoints are kept", path)

    def _apply_retention(self) -> None:
        """The only deleter (checkpoint_layout.choose_deletions): complete checkpoints beyond ``keep``, saves
        that never finished older than the newest complete one, and their quarantined kind."""
        statuses = store.scan(self.directory)
        doomed = [(s.path, "complete checkpoint" if s.complete else "unfinished save")
                  for s in store.retention_candidates(statuses, self.keep)]
        newest = next((s.step for s in statuses if s.complete), None)
        if newest is not None:
            doomed += asides.quarantined_removable(self.directory, older_than=newest)
        for path, what in doomed:
            try:
                store.remove_checkpoint(path)
                logger.info("retention (keep=%d): removed %s %s", self.keep, what, path)
            except OSError as exc:
                logger.warning("retention could not remove %s: %s; remove it by hand", path, exc)

    def _record_failure(self, step: int, path: Path, exc: BaseException) -> None:
        self.failed_saves += 1
        self.last_error = exc
        lost = peer_failure(exc)
        if lost:  # another rank died mid-save: nothing is wrong with the storage
            logger.warning("checkpoint save of step %d to %s abandoned: a peer rank is gone (%s); the latest "
                           "committed checkpoint is unchanged", step, path, lost,
                           extra={"event": "checkpoint_failed", "step": step})
            return
        if self._save_failures.failed(step, path, describe(exc), exc):  # said once a streak (save_failures.py)
            self._report("failed", step, path=str(path), detail=describe(exc))  # counted, and an incident

    def _report(self, stage: str, step: int, *, seconds: float = 0.0, bytes: int = 0, path: str = "",
                detail: str = "") -> None:
        """Tell the node agent (through the runtime's session) about a checkpoint stage; never raises."""
        try:
            (self._events or current_session()).checkpoint_event(stage, step, seconds, bytes, path=path, detail=detail)
        except Exception:
            logger.debug("could not report checkpoint stage %s", stage, exc_info=True)

    # -- restore --------------------------------------------------------------------------------------

    def restore(self, state: Mapping[str, Any], *, require: bool = False, allow_fresh_start: bool = False,
                load_attempts: int = 3, retry_delay_s: float = 1.0) -> int | None:
        """Load the newest complete checkpoint in place into ``state``; its step, or None to start fresh.

        Nothing is deleted here. Saves newer than the newest complete checkpoint (and than any committed step)
        that never finished, and newer ones whose bytes are wrong, are set aside (``step-N.unfinished`` /
        ``.corrupt`` with a note). A checkpoint that cannot be read (an I/O or permission error, or a committed
        one whose ``.metadata`` is missing) is looked at again with backoff; if it still cannot be read and it
        is newer than what would load, ``CheckpointReadError`` is raised and nothing is set aside. A checkpoint
        that fails to load is tried ``load_attempts`` times and only then set aside (``.unloadable``), unless
        the failure was a read error (then ``CheckpointReadError``); all ranks move on together.

        When nothing loads but the job has ever committed a checkpoint (``resume_evidence``: the pointer,
        etcd's record, set-aside or unreadable checkpoints), ``CheckpointUnloadableError`` is raised unless
        ``allow_fresh_start``; a fresh start allowed on purpose first sets every remaining ``step-N`` aside as
        ``.superseded``, so the new run never overwrites it. With no evidence at all, None is returned, or
        ``CheckpointNotFoundError`` raised with ``require``. Every refusal is reported to the node agent as
        ``resume_blocked`` (one incident, and the launcher stops the job without spending restarts). If every
        candidate failed and a fresh start is allowed, tensors in ``state`` may hold part of a failed load."""
        if self._closed:
            raise CheckpointError("restore() on a closed Checkpointer; create a new one")
        self.wait()
        began = time.monotonic()
        self._report("restore_start", 0, path=str(self.directory))  # the launcher records where this job checkpoints
        plan = self._group.broadcast(self._plan_restore() if self.rank == 0 else None)
        if plan.error:
            self._block(plan.error, CheckpointError)
        if plan.blocked:
            self._block(plan.blocked, CheckpointReadError)
        passed_over = list(plan.passed_over)
        if plan.memory_floor is not None:
            restored = self._restore_memory(plan.memory_floor, state, began)
            if restored is not None:
                return restored
        for step, path in plan.candidates:
            wrong = self._verify_sums(Path(path))
            if wrong:  # bytes changed since they were written: never trained on; the one before is tried
                reason = f"{len(wrong)} file(s) do not match the sums recorded at commit: " + "; ".join(wrong[:4])
                passed_over.append(f"{path}: corrupt ({reason})")
                if self.rank == 0:
                    self._quarantine(step, Path(path), store.CORRUPT, reason)
                self._group.barrier()
                continue
            failed, read_error = load_with_retries(self._group, Path(path), state, load_attempts, retry_delay_s,
                                                       rank=self.rank)
            if not failed:
                self._resumed(step, Path(path), state, began)
                return step
            if read_error:  # not proof of corruption: keep it where it is and stop
                self._block(f"checkpoint {path} could not be read on every attempt ({failed}); it was left where "
                            "it is. Fix the storage (mounts, permissions, the file server), then resume the job",
                            CheckpointReadError)
            passed_over.append(f"{path}: failed to load on every attempt ({failed})")
            if self.rank == 0:
                self._quarantine(step, Path(path), store.UNLOADABLE, failed)
            self._group.barrier()
        self._start_fresh(passed_over, plan.evidence, plan.ever_committed, require=require,
                          allow_fresh_start=allow_fresh_start)
        self._report("restored", 0, seconds=time.monotonic() - began)  # step 0: starting fresh
        return None

    def _verify_sums(self, path: Path) -> list[str]:
        """The files of ``path`` whose bytes differ from the sums in its commit marker, checked by every rank for
        its share of the files and gathered, so every rank decides the same; [] when none is recorded."""
        wrong = verify_share(path, self.rank, self.world_size)
        return sorted({w for found in self._group.gather(wrong) for w in found})

    def _resumed(self, step: int, path: Path, state: Mapping[str, Any], began: float) -> None:
        restore_rng(path, state, rank=self.rank, world_size=self.world_size)
        self._last_saved_step = step  # never re-save (and so briefly invalidate) what we resumed from
        if self.rank == 0:
            try:
                self._repoint(step, path)
            except OSError as exc:
                logger.warning("could not update the checkpoint pointer in %s: %s", self.directory, exc)
        logger.info("restored checkpoint step %d from %s", step, path,
                    extra={"event": "checkpoint_restore", "step": step})
        self._report("restored", step, seconds=time.monotonic() - began, path=str(path))

    def _start_fresh(self, passed_over: list[str], evidence: str, ever_committed: bool, *, require: bool,
                     allow_fresh_start: bool) -> None:
        """Nothing loaded: stop when the job has committed before (unless told to start over); otherwise set
        what is left aside when starting over on purpose."""
        if (passed_over or ever_committed) and not allow_fresh_start:
            why = "; ".join(passed_over)[:3000] or "no checkpoint directory could be loaded"
            self._block(f"the job has committed checkpoints ({evidence}) but none could be loaded; not starting "
                        f"from step 1, which would throw the run away: {why}. `trainwarden checkpoints` lists what "
                        "is there and why each was set aside; fix or put one back (`trainwarden checkpoints ... "
                        "restore-aside step-N`), or start over on purpose (the reference job's --allow-fresh-start)",
                        CheckpointUnloadableError)
        if require:
            self._block(f"no loadable checkpoint in {self.directory}; the job requires one: restore one there or "
                        "run without require=True", CheckpointNotFoundError)
        if (ever_committed or passed_over) and self.rank == 0:  # on purpose: keep it out of the new run's way
            for status in store.scan(self.directory):
                self._quarantine(status.step, status.path, store.SUPERSEDED,
                                 "a fresh start was allowed on purpose (allow_fresh_start); kept, never overwritten")
        if ever_committed or passed_over:
            self._group.barrier()
        logger.warning("no loadable checkpoint in %s; starting fresh (%s)", self.directory, evidence)

    def _block(self, message: str, error: type[CheckpointError]) -> None:
        """Report why the job may not resume (the agent records one incident; the launcher stops the job
        without spending a restart), then raise ``error``."""
        if self.rank == 0:
            logger.error("%s", message, extra={"event": "resume_blocked"})
            self._report("resume_blocked", 0, path=str(self.directory), detail=message[:1000])
        raise error(message)

    def _quarantine(self, step: int, path: Path, state: str, reason: str) -> None:
        """Rank 0: move a checkpoint aside (never delete it) and report it."""
        try:
            target = str(asides.quarantine(path, state=state, reason=reason))
        except OSError as exc:
            target = f"nowhere (could not move it: {exc})"
        logger.error("checkpoint %s is %s; moved to %s for inspection (%s)", path, state, target, reason[:500],
                     extra={"event": "checkpoint_quarantined", "step": step})
        self._report("set_aside", step, path=target, detail=f"{state}: {reason}"[:1000])

    def _repoint(self, step: int, path: Path) -> None:
        """After a fallback (or a crash between ``.metadata`` and the pointer) the pointer may name another
        checkpoint: point it, and ``on_commit``, at the one the job actually continues from."""
        latest = store.read_latest(self.directory)
        if latest is not None and Path(latest.path) == path.resolve():
            return
        info = store.info_for(store.CheckpointStatus(step=step, path=path, problems=()))
        store.write_latest(self.directory, info)
        logger.warning("checkpoint pointer %s now names step %d (was %s)", self.directory / store.POINTER_NAME,
                       step, latest.path if latest else "absent")
        self._report("committed", step, bytes=info.bytes, path=info.path)
        if self._on_commit is not None:
            try:
                self._on_commit(info)
            except Exception:
                logger.exception("on_commit callback failed for %s", path)

    def _plan_restore(self) -> RestorePlan:
        """Rank 0: what to try, what was passed over, and whether the job may not resume at all."""
        return plan_restore(self.directory, record=self._committed_record, read_backoff_s=self.read_backoff_s,
                            keeps_memory=self.memory is not None, quarantine=self._quarantine)

    def _committed_record(self) -> tuple[int | None, str]:
        """(step, source) of etcd's record of the job's checkpoint in this directory, asked of the node agent;
        (None, why) when there is none, it is unknown, or it names another directory."""
        session = self._events or current_session()
        ask = getattr(session, "committed_record", None)
        if ask is None:
            return None, "unknown (no node agent)"
        try:
            step, path, source = ask()
        except Exception as exc:
            logger.warning("could not ask the node agent for the job's committed checkpoint: %s", exc)
            return None, f"unknown ({exc})"
        if step is not None and path and Path(path).resolve().parent != self.directory.resolve():
            return None, f"{source} names step {step} in another directory ({path}): not counted here"
        return step, (f"step {step}" if step is not None else source)

    def close(self) -> None:
        """Wait for the in-flight save, then release the stager's buffers, the committer thread and the
        process group this Checkpointer created."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self.memory is not None:
                self.memory.close()
            if self.peer is not None:  # after the memory: its last snapshot is sent first
                self.peer.close(barrier=self._peer_barrier)
            self._committer.shutdown(wait=True)
            self._post_commit.shutdown(wait=True)
            self._stager.release()
            if self._owns_pg and self._pg is not None:
                dist.destroy_process_group(self._pg)
            self._pg = None

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


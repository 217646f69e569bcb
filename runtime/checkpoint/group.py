"""The Checkpointer's collectives on its process group: rank 0's object to every rank, every rank's object to every
rank, a barrier. Without an initialised process group (one process) each is what it would be for a world of one."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["GroupCollectives"]


class GroupCollectives:
    """``pg`` None with ``distributed`` True is the default group, as in ``torch.distributed``'s own calls."""

    def __init__(self, pg, *, distributed: bool) -> None:
        self.pg, self.distributed = pg, distributed

    def broadcast(self, obj):
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.pg, group_src=0)
        return box[0]

    def gather(self, obj) -> list:
        if not self.distributed:
            return [obj]
        out: list = [None] * dist.get_world_size(self.pg)
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.pg)

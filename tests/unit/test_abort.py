"""An agent-ordered abort: NCCL communicators are aborted before the process exits (issue 9, defect 8).

Before the fix ``abort_process`` went straight to ``os._exit``; a kernel wedged in a collective kept its GPU
and its peers' communicators busy into the restart. CPU machines have no NCCL: these tests use a fake
``torch.distributed`` with the same surface; the gloo test uses the real one."""

from __future__ import annotations

import threading
import types

import pytest

from trainwarden.runtime import abort as agent_abort
from trainwarden.runtime.abort import EXIT_ABORTED, abort_collectives, abort_process


def fake_dist(backend: str, abort=None, initialized: bool = True):
    calls = []

    def default_abort():
        calls.append("abort")

    return types.SimpleNamespace(
        is_available=lambda: True, is_initialized=lambda: initialized, get_backend=lambda: backend,
        distributed_c10d=types.SimpleNamespace(_abort_process_group=abort or default_abort)), calls


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_nccl_process_groups_are_aborted(backend):
    dist, calls = fake_dist(backend)
    assert abort_collectives(1.0, dist=dist) == "aborted"
    assert calls == ["abort"]


def test_gloo_and_uninitialized_groups_are_left_alone():
    dist, calls = fake_dist("gloo")
    assert abort_collectives(1.0, dist=dist) == "gloo: nothing to abort"
    dist, calls2 = fake_dist("nccl", initialized=False)
    assert abort_collectives(1.0, dist=dist) == "no process group"
    assert calls == calls2 == []


def test_a_blocked_abort_does_not_keep_the_process_alive():
    release = threading.Event()
    dist, _ = fake_dist("nccl", abort=lambda: release.wait(30))
    try:
        assert abort_collectives(0.2, dist=dist) == "abort still blocked after 0.2s"
    finally:
        release.set()


def test_a_failing_abort_is_reported_not_raised():
    def boom():
        raise RuntimeError("communicator already destroyed")
    dist, _ = fake_dist("nccl", abort=boom)
    assert abort_collectives(1.0, dist=dist) == "abort failed: communicator already destroyed"


def test_abort_process_aborts_collectives_before_it_exits(monkeypatch):
    order = []
    monkeypatch.setattr(agent_abort, "abort_collectives", lambda timeout_s: order.append("collectives"))

    class Exited(BaseException):
        pass

    def fake_exit(code):
        order.append(("exit", code))
        raise Exited

    monkeypatch.setattr(agent_abort.os, "_exit", fake_exit)
    with pytest.raises(Exited):
        abort_process("hang", flush=lambda: order.append("flush"))
    assert order == ["flush", "collectives", ("exit", EXIT_ABORTED)]


def test_real_gloo_group_is_not_aborted(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert abort_collectives(1.0) == "gloo: nothing to abort"
    finally:
        dist.destroy_process_group()

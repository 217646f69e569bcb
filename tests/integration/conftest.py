"""Fixtures more than one integration module uses."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def trained_with_copies(tmp_path_factory, request) -> tuple[Path, str]:
    """(directory, training log) of one run of ``ckpt_worker.py`` (4 ranks on two simulated nodes, node map 0,0,1,1):
    5 steps, a memory snapshot every step sent to the same local rank on the other node (``--per-node 2``), the
    disk every 2 steps. test_memory_reshard.py and test_memory_sums.py restore from it; each test copies the
    directories before it changes anything, so one run (~20 s) serves both modules."""
    from integration.test_checkpoint import torchrun
    from procs import ProcessGroup

    base = tmp_path_factory.mktemp("memory-copies")
    procs = ProcessGroup()
    request.addfinalizer(procs.close)
    log = torchrun(procs, 4, base / "train.log", "train", "--dir", str(base / "ckpt"), "--dump-dir", str(base),
                   "--steps", "5", "--save-every", "2", "--memory-root", str(base / "mem"), "--node-map", "0,0,1,1",
                   "--per-node", "2")
    return base, log


@pytest.fixture
def server(tmp_path):
    """A real telemetry server (the agent's) on a socket of its own, and its store: (server, JobTelemetry)."""
    from trainwarden.agent.telemetry.job_telemetry import JobTelemetry
    from trainwarden.agent.telemetry.server import TelemetryServer

    js = JobTelemetry()
    srv = TelemetryServer(tmp_path / "run" / "agent.sock", js, max_message_bytes=4096)
    srv.start()
    try:
        yield srv, js
    finally:
        srv.stop(0.5)

"""The packages' public names import, and the agent's import path stays free of torch."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

AGENT_MODULES = [
    "trainwarden.agent", "trainwarden.agent.cli", "trainwarden.agent.launch.run", "trainwarden.agent.node.agent",
    "trainwarden.agent.node.daemon", "trainwarden.agent.cli.status", "trainwarden.agent.watchdog.loop",
    "trainwarden.agent.metrics.exporter", "trainwarden.agent.health", "trainwarden.agent.telemetry.server",
]


def test_agent_import_path_does_not_import_torch():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in AGENT_MODULES) +
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_runtime_public_names():
    import trainwarden.runtime as rt
    from trainwarden.runtime.checkpoint import Checkpointer, find_complete, validate  # noqa: F401
    from trainwarden.runtime.faults import FaultInjector, parse_faults  # noqa: F401

    for name in rt.__all__:
        assert getattr(rt, name) is not None


def test_rendezvous_entry_point_is_registered():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="torchrun.handlers")}
    assert eps.get("etcd3") == "trainwarden.agent.rendezvous:handler_factory"

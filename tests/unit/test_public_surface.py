"""The packages' public names import, and the agent's import path stays free of torch."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
# every agent module but the rendezvous backend, which runs inside torchrun and imports torch
AGENT_MODULES = sorted(
    "trainwarden.agent." + ".".join(p.relative_to(ROOT / "agent").with_suffix("").parts).removesuffix(".__init__")
    for p in (ROOT / "agent").rglob("*.py")
    if (p.parent.name != "rendezvous" or p.name == "__init__.py") and p.name != "__main__.py")
AGENT_PACKAGES = sorted("trainwarden.agent." + p.parent.name for p in (ROOT / "agent").glob("*/__init__.py"))


def test_agent_import_path_does_not_import_torch():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in AGENT_MODULES) +
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_agent_packages_public_names():
    assert len(AGENT_PACKAGES) >= 12, AGENT_PACKAGES
    for name in AGENT_PACKAGES:
        package = importlib.import_module(name)
        for public in getattr(package, "__all__", ()):
            assert getattr(package, public) is not None, f"{name}.{public}"


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

"""The project as a user installs it: a wheel that holds every package, and code that passes the linter."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _packages() -> set[str]:
    found = set()
    for top, name in (("agent", "trainwarden.agent"), ("runtime", "trainwarden.runtime")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            found.add(".".join([name, *rel.parts]))
    return found


@pytest.mark.timeout(240)
def test_the_wheel_holds_every_package_and_its_entry_points_work(tmp_path):
    pytest.importorskip("setuptools")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(ROOT)], check=True, timeout=200, cwd=tmp_path)
    [wheel] = list((tmp_path / "dist").glob("trainwarden-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in _packages():
        assert package.replace(".", "/") + "/__init__.py" in names, f"{package} is missing from the wheel"
    assert "trainwarden/agent/shared/telemetry.proto" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "trainwarden = trainwarden.agent.cli:entry" in text
    assert "etcd3 = trainwarden.agent.rendezvous:handler_factory" in text

    # installed from the wheel alone (not the editable checkout): the command runs and the backend loads
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=120)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]])}
    code = ("import trainwarden.agent, trainwarden.agent.rendezvous as r, trainwarden.agent.cli as c;"
            "assert trainwarden.agent.__file__.startswith(%r), trainwarden.agent.__file__;"
            "assert callable(r.handler_factory()); raise SystemExit(c.main(['--version']))" % str(site))
    out = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("trainwarden ")


@pytest.mark.timeout(60)
def test_the_code_passes_the_linter():
    ruff = pytest.importorskip("ruff")
    del ruff
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--quiet", str(ROOT / "agent"), str(ROOT / "runtime"),
                          str(ROOT / "tests")], capture_output=True, text=True, timeout=50, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr

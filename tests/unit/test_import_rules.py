"""The import graph keeps its rules (docs/ARCHITECTURE.md, "Layers"):

- the agent never imports the runtime (``trainwarden.runtime``);
- the runtime imports nothing of the agent but the shared package (``trainwarden.agent.shared``), the leaf
  both sides share;
- inside the agent, a sub-package imports only sub-packages of its own layer or below, and no two
  sub-packages import each other (one way only).

Read from the source with ``ast``, so a lazy import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]

LAYERS = {
    "shared": 0,
    "common": 1,
    "etcd": 2,
    "health": 3, "telemetry": 3, "incidents": 3, "rendezvous": 3,
    "linkcheck": 3,
    "watchdog": 4, "metrics": 4,
    "node": 5,
    "launch": 6, "report": 6,
    "cli": 7,
}
"""Sub-packages of trainwarden.agent, lowest first: CLI -> launch, report -> node -> watchdog/metrics ->
telemetry, incidents, rendezvous, health -> etcd -> common -> shared."""


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    top = {"agent": "trainwarden.agent", "runtime": "trainwarden.runtime"}[parts[0]]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([top, *parts[1:]])


def imports_of(path: Path, module: str) -> set[str]:
    """Every trainwarden module that ``path`` (the module ``module``) imports, anywhere in its body."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)  # `from pkg import submodule`
    return {name for name in found if name.startswith("trainwarden.")}


def graph(root: Path) -> dict[str, set[str]]:
    edges = {}
    for top in ("agent", "runtime"):
        for path in sorted((root / top).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            module = module_name(path, root)
            edges[module] = imports_of(path, module)
    return edges


def subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "agent" else None


ALLOWED: frozenset[tuple[str, str]] = frozenset()
"""Edges the rules would refuse, each on purpose: none. (The warm workers' zygote, which arms the runtime's
auto-instrumentation in the worker it forks, was agent code until issue 46 moved it to runtime/zygote.py.)"""


def violations(edges: dict[str, set[str]]) -> list[str]:
    problems: list[str] = []
    reported: set[tuple[str, str]] = set()
    package_edges: set[tuple[str, str]] = set()
    for source, targets in sorted(edges.items()):
        for target in sorted(targets):
            if (source, target) in ALLOWED or (source, target.rpartition(".")[0]) in ALLOWED:
                continue
            if source.startswith("trainwarden.agent") and target.startswith("trainwarden.runtime"):
                problems.append(f"{source} imports the runtime ({target}): the agent never does")
            if source.startswith("trainwarden.runtime") and target.startswith("trainwarden.agent") \
                    and not target.startswith("trainwarden.agent.shared") and target != "trainwarden.agent":
                problems.append(f"{source} imports {target}: the runtime may import only trainwarden.agent.shared")
            src, dst = subpackage(source), subpackage(target)
            if src is None or dst is None or src == dst or dst not in LAYERS:
                continue
            if src not in LAYERS:
                problems.append(f"{source}: sub-package {src} has no layer in this test; give it one")
                continue
            package_edges.add((src, dst))
            if LAYERS[dst] > LAYERS[src] and (source, dst) not in reported:
                reported.add((source, dst))
                problems.append(f"{source} imports {target}: {src} (layer {LAYERS[src]}) may not import "
                                f"{dst} (layer {LAYERS[dst]}), which sits above it")
    for a, b in sorted(package_edges):
        if a < b and (b, a) in package_edges:
            problems.append(f"sub-packages {a} and {b} import each other")
    return problems


def test_the_import_graph_keeps_its_rules():
    edges = graph(ROOT)
    assert "trainwarden.agent.node.agent" in edges and "trainwarden.runtime.session" in edges
    assert violations(edges) == []


def test_every_agent_subpackage_has_a_layer():
    packages = {p.name for p in (ROOT / "agent").iterdir() if (p / "__init__.py").exists()}
    assert packages == set(LAYERS)


def test_every_subpackage_says_what_it_owns():
    for name in LAYERS:
        doc = ast.get_docstring(ast.parse((ROOT / "agent" / name / "__init__.py").read_text()))
        assert doc and len(doc) > 80, f"agent/{name}/__init__.py needs a docstring: what it owns, what it imports"


def test_an_agent_module_importing_the_runtime_is_caught(tmp_path):
    (tmp_path / "agent" / "watchdog").mkdir(parents=True)
    (tmp_path / "runtime").mkdir()
    (tmp_path / "agent" / "watchdog" / "__init__.py").write_text("")
    (tmp_path / "agent" / "watchdog" / "loop.py").write_text(
        "def f():\n    from trainwarden.runtime.session import init\n")
    (tmp_path / "runtime" / "session.py").write_text("from trainwarden.agent.etcd.client import open_client\n")
    (tmp_path / "agent" / "etcd").mkdir()
    (tmp_path / "agent" / "etcd" / "client.py").write_text("from ..node import agent\n")
    problems = violations(graph(tmp_path))
    assert any("trainwarden.agent.watchdog.loop imports the runtime" in p for p in problems), problems
    assert any("runtime may import only trainwarden.agent.shared" in p for p in problems), problems
    assert any("etcd (layer 2) may not import node (layer 5)" in p for p in problems), problems

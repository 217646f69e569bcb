"""Figures of the GPU checks (`make gpu-check`): each check writes ``<dir>/<check>.json``; `merge` folds them
into one JSON with the machine they ran on.

``TRAINWARDEN_GPU_FIGURES`` names the directory; without it (a plain pytest run) figures are not written.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

FIGURES_ENV = "TRAINWARDEN_GPU_FIGURES"


def record(check: str, **values: Any) -> None:
    """Write one check's figures (JSON-able values) where `make gpu-check` collects them."""
    directory = os.environ.get(FIGURES_ENV)
    if not directory:
        return
    path = Path(directory) / f"{check}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(values, indent=2, default=str))


def merge(directory: str | Path, *, machine: dict | None = None) -> dict:
    """Every check's figures under ``directory``, by check name; ``machine`` describes where they ran."""
    checks = {}
    for path in sorted(Path(directory).glob("*.json")):
        try:
            checks[path.stem] = json.loads(path.read_text())
        except ValueError as exc:
            checks[path.stem] = {"error": f"unreadable figures: {exc}"}
    return {"machine": machine or {}, "checks": checks}


def machine() -> dict:
    """The GPU, driver and torch the figures come from."""
    out: dict[str, Any] = {}
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
            out["gpus"] = torch.cuda.device_count()
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:
        out["error"] = repr(exc)
    return out


if __name__ == "__main__":  # python tests/gpu/gpu_figures.py DIR OUT
    result = merge(sys.argv[1], machine=machine())
    Path(sys.argv[2]).write_text(json.dumps(result, indent=2))
    print(f"{len(result['checks'])} GPU checks' figures in {sys.argv[2]}")

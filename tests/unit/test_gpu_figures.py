"""The figures `make gpu-check` writes: one file per check, merged into one JSON (tests/gpu/gpu_figures.py)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))

import gpu_figures  # noqa: E402


def test_checks_write_their_figures_only_under_make_gpu_check_and_merge_into_one_json(tmp_path, monkeypatch):
    monkeypatch.delenv(gpu_figures.FIGURES_ENV, raising=False)
    gpu_figures.record("ignored", x=1)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(gpu_figures.FIGURES_ENV, str(tmp_path / "figures"))
    gpu_figures.record("cuda_step_timing", gpu_ms=[100.2], within_pct=0.4)
    gpu_figures.record("nccl_recorder", durations_ms=[0.02])
    (tmp_path / "figures" / "broken.json").write_text("{")
    merged = gpu_figures.merge(tmp_path / "figures", machine={"gpu": "H100"})
    assert merged["machine"] == {"gpu": "H100"}
    assert merged["checks"]["cuda_step_timing"] == {"gpu_ms": [100.2], "within_pct": 0.4}
    assert set(merged["checks"]) == {"cuda_step_timing", "nccl_recorder", "broken"}
    assert "error" in merged["checks"]["broken"]
    json.dumps(merged)

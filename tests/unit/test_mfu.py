"""Model FLOPs utilization (agent/launch/mfu.py): GPU names to peaks, and the ratio from a job's telemetry for a
step cost given in FLOPs or in parameters, on jobs of other shapes than the reference."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from trainwarden.agent.launch.mfu import MfuGauge, detect_peak_tflops, peak_for_name


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                        ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A10", 125.0),
                                        ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0), ("NVIDIA H200", 989.0),
                                        ("Tesla V100-SXM2-32GB", 125.0), ("Some Future GPU", None)])
def test_known_gpus_have_their_peak_and_the_specific_name_wins(name, peak):
    assert peak_for_name(name) == peak


def _snapshot(world: int, ranks: list[tuple[float, float]]):
    """A job snapshot with (step p50 seconds, tokens/s) per local rank."""
    return lambda job: [SimpleNamespace(world_size=world, ranks=[
        SimpleNamespace(step_p50_seconds=p50, tokens_per_second=tps) for p50, tps in ranks])]


def test_flops_per_step_counts_this_nodes_share_of_the_job():
    # 64 ranks over 8 nodes; this node's 8 step in 0.5 s; 1e17 FLOPs a step over 64 accelerators of 1000 TFLOPS
    gauge = MfuGauge("j", "n0", _snapshot(64, [(0.5, 0.0)] * 8), peak_tflops=1000.0, flops_per_step=1e17)
    assert gauge.ratio() == pytest.approx(1e17 / 0.5 / 64 / 1e15)


def test_model_params_count_six_flops_per_parameter_and_token_the_ranks_report():
    gauge = MfuGauge("j", "n0", _snapshot(2, [(0.1, 5000.0), (0.1, 5000.0)]), peak_tflops=0.001, model_params=1e6)
    assert gauge.ratio() == pytest.approx(6e6 * 10_000 / (1e9 * 2))
    registry = CollectorRegistry()
    registry.register(gauge)
    assert 'trainwarden_mfu_ratio{job="j",node="n0"} 30.0' in generate_latest(registry).decode()


def test_no_steps_yet_no_value_and_bad_arguments_are_refused():
    assert MfuGauge("j", "n0", lambda job: [], peak_tflops=1.0, model_params=1.0).ratio() is None
    assert MfuGauge("j", "n0", _snapshot(1, [(0.0, 0.0)]), peak_tflops=1.0, flops_per_step=1.0).ratio() is None
    with pytest.raises(ValueError):
        MfuGauge("j", "n0", lambda job: [], peak_tflops=1.0, flops_per_step=1.0, model_params=1.0)
    with pytest.raises(ValueError):
        MfuGauge("j", "n0", lambda job: [], peak_tflops=0.0, flops_per_step=1.0)


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this machine has a GPU")
def test_without_a_gpu_the_peak_is_unknown_rather_than_guessed():
    assert detect_peak_tflops() is None

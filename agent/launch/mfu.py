"""Model FLOPs utilization (issue 27): the share of the accelerators' peak that the model's own arithmetic uses.

Given by the user, never guessed: the model's FLOPs per training step of the whole job (``--flops-per-step``), or
its parameter count (``--model-params N``), with which a step costs 6·N FLOPs per token (forward and backward of a
dense transformer, attention left out) over the tokens the job's ranks report (``rt.step(tokens=...)``: each rank
its own share, so the ranks' sum is the job's; or ``--tokens-per-step`` for an auto-instrumented script). The peak
is ``--peak-tflops`` per accelerator, else looked up from the GPU's NVML name (``PEAK_TFLOPS``: dense BF16 tensor
throughput from the vendor's data sheets). Without both, no MFU is exported, and the summary says what is missing.

``MfuGauge`` is a prometheus_client collector of ``trainwarden_mfu_ratio{job,node}`` over this node's ranks, from
the node agent's telemetry snapshot: achieved FLOPs/s = flops_per_step / median step time × (local ranks / world
size), or 6·N × the local ranks' tokens/s; divided by the peak × local ranks.
"""

from __future__ import annotations

import logging
import statistics
from typing import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

logger = logging.getLogger(__name__)

__all__ = ["MfuGauge", "PEAK_TFLOPS", "detect_peak_tflops", "peak_for_name"]

PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0), ("B200", 2250.0), ("B100", 1750.0),
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H800 PCIe", 756.0), ("GH200", 989.0), ("H200", 989.0),
    ("H100", 989.0), ("H800", 989.0), ("H20", 148.0),
    ("A100", 312.0), ("A800", 312.0), ("A30", 165.0), ("A40", 150.0), ("A10G", 70.0), ("A10", 125.0),
    ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0), ("V100", 125.0), ("T4", 65.0),
)
"""(substring of the NVML device name, dense BF16/FP16 tensor TFLOPS per GPU); the first match wins, so the more
specific names come first (``A100`` before ``A10``, ``H100 PCIe`` before ``H100``)."""


def peak_for_name(name: str) -> float | None:
    for part, tflops in PEAK_TFLOPS:
        if part.lower() in name.lower():
            return tflops
    return None


def detect_peak_tflops() -> tuple[float, str] | None:
    """The first GPU's peak and name from NVML (never CUDA: this process forks workers); None without one."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver, no GPU
        return None
    try:
        if pynvml.nvmlDeviceGetCount() < 1:
            return None
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        name = name.decode() if isinstance(name, bytes) else str(name)
        peak = peak_for_name(name)
        if peak is None:
            logger.info("no known peak for GPU %r: pass --peak-tflops for an MFU", name)
            return None
        return peak, name
    except Exception as exc:
        logger.info("cannot read the GPU's name from NVML (%s): pass --peak-tflops for an MFU", exc)
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


class MfuGauge:
    """``trainwarden_mfu_ratio{job,node}`` (module docstring)."""

    def __init__(self, job: str, node: str, snapshot: Callable[[str], list], *, peak_tflops: float,
                 flops_per_step: float = 0.0, model_params: float = 0.0) -> None:
        if peak_tflops <= 0 or (flops_per_step <= 0) == (model_params <= 0):
            raise ValueError("MfuGauge needs a peak and exactly one of flops_per_step and model_params")
        self.job, self.node, self._snapshot = job, node, snapshot
        self.peak_flops = peak_tflops * 1e12
        self.flops_per_step, self.model_params = flops_per_step, model_params

    def ratio(self) -> float | None:
        snaps = self._snapshot(self.job)
        if not snaps:
            return None
        snap = snaps[0]
        ranks = [r for r in snap.ranks if r.step_p50_seconds > 0]
        if not ranks:
            return None
        if self.flops_per_step:
            step_s = statistics.median(r.step_p50_seconds for r in ranks)
            world = max(snap.world_size, len(ranks))
            achieved = self.flops_per_step / step_s * len(ranks) / world
        else:
            tokens_per_s = sum(r.tokens_per_second for r in ranks)
            if tokens_per_s <= 0:
                return None
            achieved = 6.0 * self.model_params * tokens_per_s
        return achieved / (self.peak_flops * len(ranks))

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily("trainwarden_mfu_ratio", "Model FLOPs utilization of this node's ranks: the model's "
                                  "FLOPs per second (as the job's --flops-per-step or --model-params says) over the "
                                  "accelerators' peak", labels=["job", "node"])
        try:
            value = self.ratio()
        except Exception:  # a scrape never fails for it
            logger.exception("computing the MFU of job %s failed", self.job)
            value = None
        if value is not None:
            gauge.add_metric([self.job, self.node], value)
        yield gauge

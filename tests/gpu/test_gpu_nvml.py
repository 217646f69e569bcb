"""Every reading of the GPU health sampler (agent/health/nvml.py) against ``nvidia-smi -q -x``, on real GPUs.

Static readings (UUID, name, memory total, ECC and remapped-row counts, PCIe replays) must agree exactly; readings
that move (utilization, memory used, temperature, power, SM clock) within a tolerance, since the two are read
moments apart; a field nvidia-smi shows as N/A must be left out by the sampler (NVMLError_NotSupported)."""

import shutil
import subprocess
import time
import xml.etree.ElementTree as ET

import pytest
import torch

import gpu_figures
from trainwarden.agent.health import GpuHealthConfig, GpuHealthSampler

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120),
              pytest.mark.skipif(not torch.cuda.is_available() or shutil.which("nvidia-smi") is None,
                                 reason="needs a CUDA GPU and nvidia-smi")]


def _number(node, *paths):
    """The first of ``paths`` that exists under ``node``, as a float; None for N/A or absent."""
    for path in paths:
        found = node.find(path)
        if found is not None and found.text:
            text = found.text.strip().split()[0]
            if text in ("N/A", "[N/A]", "Unknown", "[Not"):
                return None
            if text in ("Yes", "No"):
                return 1.0 if text == "Yes" else 0.0
            try:
                return float(text)
            except ValueError:
                return None
    return None


def _smi() -> list:
    root = ET.fromstring(subprocess.run(["nvidia-smi", "-q", "-x"], capture_output=True, text=True,
                                        check=True, timeout=60).stdout)
    return root.findall("gpu")


TOLERANCE = {"utilization_ratio": 0.5, "memory_busy_ratio": 0.5, "memory_used_bytes": 2 * 2**30,
             "temperature_celsius": 5.0, "power_watts": 0.3, "sm_clock_hertz": 0.5}
"""Absolute for ratios, bytes and degrees; relative for power and clock (they follow load between the reads)."""


def _settle(sampler, within: float = 0.05, limit_s: float = 15.0) -> None:
    """Sample until each GPU's power stops moving (two readings half a second apart within ``within``), for at most
    ``limit_s``: the checks before this one leave the GPU hot, and its power falls for a few seconds."""
    deadline, last = time.monotonic() + limit_s, None
    while True:
        sampler.sample()
        now = [s.power_watts for s in sampler.samples]
        if last is not None and all(a is None or b is None or abs(a - b) <= within * max(abs(b), 1.0)
                                    for a, b in zip(now, last)):
            return
        if time.monotonic() >= deadline:
            return
        last = now
        time.sleep(0.5)


def test_every_nvml_reading_matches_nvidia_smi():
    sampler = GpuHealthSampler(GpuHealthConfig(node="gpu-check"))
    assert sampler.open(), sampler.unavailable_reason
    try:
        _settle(sampler)
        samples = {s.index: s for s in sampler.samples}
        gpus = {g.index: g for g in sampler._gpus}
        smi = _smi()
        sampler.sample()  # again after nvidia-smi: a reading that moved between the reads is judged on both
        after = {s.index: s for s in sampler.samples}
    finally:
        sampler.stop()
    rows, mismatches = [], []
    for index, node in enumerate(smi):
        s = samples[index]
        expected = {
            "uuid": (node.findtext("uuid") or "").strip(), "name": (node.findtext("product_name") or "").strip(),
            "memory_total_bytes": _number(node, "fb_memory_usage/total"),
            "memory_used_bytes": _number(node, "fb_memory_usage/used"),
            "utilization_ratio": _number(node, "utilization/gpu_util"),
            "memory_busy_ratio": _number(node, "utilization/memory_util"),
            "temperature_celsius": _number(node, "temperature/gpu_temp"),
            "power_watts": _number(node, "gpu_power_readings/power_draw", "power_readings/power_draw",
                                   "gpu_power_readings/instant_power_draw"),
            "sm_clock_hertz": _number(node, "clocks/sm_clock"),
            "ecc_corrected": _number(node, "ecc_errors/volatile/dram_correctable",
                                     "ecc_errors/volatile/single_bit/total"),
            "ecc_uncorrected": _number(node, "ecc_errors/volatile/dram_uncorrectable",
                                       "ecc_errors/volatile/double_bit/total"),
            "remapped_correctable": _number(node, "remapped_rows/remapped_row_corr"),
            "remapped_uncorrectable": _number(node, "remapped_rows/remapped_row_unc"),
            "remap_pending": _number(node, "remapped_rows/remapped_row_pending"),
            "remap_failed": _number(node, "remapped_rows/remapped_row_failure"),
            "pcie_replays": _number(node, "pci/replay_counter"),
        }
        # nvidia-smi's units: MiB, %, C, W, MHz
        for key, scale in (("memory_total_bytes", 2**20), ("memory_used_bytes", 2**20), ("utilization_ratio", 0.01),
                           ("memory_busy_ratio", 0.01), ("sm_clock_hertz", 1e6)):
            if expected[key] is not None:
                expected[key] *= scale
        got = {"uuid": gpus[index].uuid, "name": gpus[index].name,
               **{k: getattr(s, k) for k in expected if k not in ("uuid", "name")}}
        later = {k: getattr(after[index], k) for k in TOLERANCE}
        for key, want in expected.items():
            have = got[key]
            if isinstance(have, bool):
                have = float(have)
            if want is None or have is None:
                ok = want is None and have is None  # unsupported on both sides
            elif key in ("uuid", "name"):
                ok = have == want
            elif key == "memory_total_bytes":
                ok = abs(have - want) < 2**20  # nvidia-smi rounds to MiB
            elif key in TOLERANCE:
                # nvidia-smi read between the two samples: within the tolerance of either, or between them (an
                # H200 still cooling from the checks before read 623 W, nvidia-smi 132 W a moment later)
                pair = [have] if later[key] is None else [have, later[key]]
                slack = TOLERANCE[key] * (max(abs(want), 1.0) if key in ("power_watts", "sm_clock_hertz") else 1.0)
                ok = min(pair) - slack <= want <= max(pair) + slack
            else:
                ok = float(have) == float(want)
            rows.append({"gpu": index, "reading": key, "nvml": have, "nvml_after": later.get(key), "nvidia_smi": want,
                         "agree": ok})
            if not ok:
                mismatches.append(rows[-1])
    gpu_figures.record("nvml_vs_nvidia_smi", gpus=len(smi), readings=rows, mismatches=mismatches)
    assert len(smi) == len(samples)
    assert not mismatches, mismatches

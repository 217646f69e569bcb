"""Node health for the agent: GPUs through NVML, the host through psutil.

Each sampler reads its source on its own daemon thread and is also a prometheus_client collector that
formats the latest reading at scrape time (register it with ``trainwarden.agent.metrics.exporter.build_registry``).
``GpuHealthSampler.unhealthy_reasons()`` is the GPU verdict the agent uses to cordon a node. It imports nothing
of trainwarden beyond itself (NVML and psutil are constructor parameters).
"""

from trainwarden.agent.health.host import HostHealthConfig, HostHealthSampler, HostSample
from trainwarden.agent.health.nvml import GpuHealthConfig, GpuHealthSampler, GpuSample
from trainwarden.agent.health.sampler import PeriodicSampler

__all__ = [
    "GpuHealthConfig",
    "GpuHealthSampler",
    "GpuSample",
    "HostHealthConfig",
    "HostHealthSampler",
    "HostSample",
    "PeriodicSampler",
]

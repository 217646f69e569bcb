"""What `trainwarden run` was asked to do (``RunOptions``), checked once as it is made: each launch option by its
one declaration (agent/common/launch_options.py), then the checks across options and the launch's own
(agent/launch/torchrun.py ``validate_launch``). agent/launch/run.py runs it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trainwarden.agent.common.launch_options import LAUNCH_OPTIONS, OPTIONS, cross_problems
from trainwarden.agent.etcd.client import EtcdSecurity
from trainwarden.agent.launch.torchrun import parse_nnodes, validate_launch
from trainwarden.agent.shared.contract import validate_node_name

__all__ = ["RunOptions"]


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """What `trainwarden run` was asked to do."""

    script: list[str]
    """The worker command: ``[path, args...]`` or ``["-m", module, args...]``."""
    job: str
    """Job name."""
    nproc_per_node: int = 1
    """Workers on this node."""
    nnodes: str = "1"
    """``N`` or ``MIN:MAX``."""
    spare_nodes: int = 0
    """Hot spares: with ``--nnodes MIN:N`` and N+K nodes running the command, N train and K wait in the rendezvous;
    a spare takes a lost node's ranks in the next round (agent/rendezvous/native.py, **Ranks**); with none left the
    job shrinks to MIN or more."""
    etcd: str | None = None
    """``host:port`` (or ``http[s]://host:port``) of a running etcd; None starts an embedded one."""
    etcd_security: EtcdSecurity = field(default_factory=EtcdSecurity)
    """TLS and auth for ``etcd``: the run's own clients and torchrun's rendezvous take the same settings."""
    max_restarts: int = 3
    """Worker-group restarts before the job fails."""
    monitor_interval: float = 0.25
    """Seconds between torchrun's health checks of its workers."""
    state_home: Path | None = None
    """Root of job state directories (default: see ``paths.default_state_home``)."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """More environment for the workers."""
    local_addr: str | None = None
    """Address this node advertises in the rendezvous; None: loopback for a one-node job, else the address
    of the interface that routes to etcd."""
    node: str | None = None
    """This node's name in the job (its record ``jobs/<job>/nodes/<node>``, metric labels, incidents);
    None: the host name."""
    agent: bool = True
    """Run a node agent in-process (telemetry, metrics, watchdog)."""
    metrics_host: str = "127.0.0.1"
    """Address of the agent's Prometheus endpoint."""
    metrics_port: int = 9478
    """Port of the agent's Prometheus endpoint (0: a free one)."""
    straggler_policy: str = "alert"
    """``alert`` or ``exclude`` (also ask for this node's exclusion at the next rendezvous)."""
    link_policy: str = "alert"
    """``alert`` or ``exclude`` (a node a link check names slow leaves the job and is cordoned)."""
    hang_floor_s: float | None = None
    """The hang deadline's floor (``--hang-floor``); None: the watchdog's default (agent/watchdog/hang.py)."""
    numeric_policy: str = "rollback"
    """What the workers' numeric guard does with a non-finite step (``NUMERIC_POLICIES``; runtime/numeric.py)."""
    managed: bool = False
    """Started by the node daemon for a submitted job: the spec in etcd is the operator's, never rewritten."""
    warm_workers: bool = True
    """Restarted workers fork from a process with torch imported (runtime/zygote.py); False: cold starts."""
    rendezvous_round: str = "native"
    """``native``: the etcd-native round (a key per node, one closing transaction: agent/rendezvous/native.py);
    ``dynamic``: torch's dynamic rendezvous over etcd, every join a compare-and-set on one shared blob."""
    memory_snapshots: bool = True
    """Keep the workers' per-step snapshots in shared memory across restarts (agent/launch/memory_tier.py)."""
    auto_instrument: bool = True
    """Instrument the unchanged script's workers (runtime/auto.py); only with the agent."""
    tokens_per_step: int = 0
    """Tokens one step processes on one rank, for an auto-instrumented script's tokens/s (0: steps/s)."""
    flops_per_step: float = 0.0
    """The model's FLOPs per training step, all ranks together, for the MFU (agent/launch/mfu.py); 0: unknown."""
    model_params: float = 0.0
    """Or the model's parameter count: 6 FLOPs per parameter and token (0: unknown)."""
    peak_tflops: float = 0.0
    """One accelerator's peak; 0: from the GPU's NVML name."""

    def __post_init__(self) -> None:
        for option in LAUNCH_OPTIONS:  # each as declared once (agent/common/launch_options.py), as a spec's field
            if (why := option.problem(getattr(self, option.name))) is not None:
                raise ValueError(f"{option.flag} {why}")
        for why in cross_problems({o.name: getattr(self, o.name) for o in LAUNCH_OPTIONS}, lambda n: OPTIONS[n].flag):
            raise ValueError(why)
        validate_launch(self)
        if self.node is not None:
            validate_node_name(self.node)
        if parse_nnodes(self.nnodes)[1] > 1 and self.etcd is None:
            raise ValueError(f"--nnodes {self.nnodes}: a job of several nodes needs an etcd they all reach; "
                             "pass --etcd HOST:PORT[,HOST:PORT...] (the embedded etcd listens on loopback only)")

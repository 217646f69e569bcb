"""The launcher: torchrun's command line and environment with trainwarden's defaults.

``LaunchSpec`` is the typed description of one torchrun invocation; ``torchrun_command`` and
``worker_environment`` turn it into an argv and an environment. Defaults that differ from plain
torchrun, and why:

- rendezvous backend ``etcd3`` (the rendezvous outlives any one host, unlike ``c10d``);
- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: torch 2.13 otherwise shares one TCP store across restart
  rounds and restarted gloo workers fail in ``connectFullMesh`` against the previous round's keys;
- a restart budget (``--max-restarts``) and a short monitor interval, so a crash is noticed in about
  a quarter of a second;
- the runtime's environment: job name, state directory, agent socket, Flight Recorder on;
- auto-instrumentation (runtime/auto.py): the worker bootstrap's directory first on PYTHONPATH (the
  user's PYTHONPATH follows it) and ``TRAINWARDEN_AUTO_INSTRUMENT=1``, unless turned off;
- torchrun's log directory (the workers' error files) in the job's state directory, ``logs/torchelastic``
  (``torchelastic_log_dir``), not a ``torchelastic_*`` directory left in the system's temporary directory by
  every run; the supervisor empties it before each launch, so it holds the last run's files.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path


from trainwarden.agent.shared.contract import (AGENT_SOCKET_ENV, AUTO_INSTRUMENT_ENV, CHECKPOINT_DIR_ENV,
                                             FLIGHT_RECORDER_ENV, JOB_ENV, STATE_DIR_ENV, TOKENS_PER_STEP_ENV,
                                             WARM_MAP_DIR_ENV, WARM_SOCKET_ENV, ZYGOTE_MODULE, validate_job_name,
                                             warm_paths)

from trainwarden.agent.common.launch_options import OPTIONS, parse_nnodes
from trainwarden.agent.common.paths import default_checkpoint_dir
from trainwarden.agent.launch.elastic import WARM_ZYGOTE_FLAG

logger = logging.getLogger(__name__)

__all__ = ["LaunchSpec", "parse_nnodes", "torchelastic_log_dir", "torchrun_command", "validate_launch",
           "worker_environment"]


def torchelastic_log_dir(state_dir: Path) -> Path:
    """Where torchrun keeps the workers' error files for a job (module docstring)."""
    return Path(state_dir) / "logs" / "torchelastic"

def worker_bootstrap_dir() -> str:
    """The directory whose ``sitecustomize`` arms auto-instrumentation in a worker (runtime/bootstrap). The
    runtime package sits beside the agent's, installed or editable; found by path, not imported (the agent
    never imports the runtime)."""
    directory = Path(__file__).resolve().parents[2] / "runtime" / "bootstrap"
    if not (directory / "sitecustomize.py").is_file():
        raise ValueError(f"trainwarden's worker bootstrap is missing ({directory / 'sitecustomize.py'}): the "
                           "installation is incomplete; reinstall trainwarden, or run with --no-auto-instrument")
    return str(directory)


def validate_launch(spec) -> None:
    """Checks shared by every description of a launch (``LaunchSpec``, ``run.RunOptions``)."""
    validate_job_name(spec.job)
    if not spec.script or spec.script == ["-m"]:
        raise ValueError("nothing to run: give a script path or -m MODULE after the options")
    for name in ("nproc_per_node", "max_restarts", "nnodes"):  # as declared once: agent/common/launch_options.py
        if (why := OPTIONS[name].problem(getattr(spec, name))) is not None:
            raise ValueError(f"{OPTIONS[name].flag} {why}")
    if spec.monitor_interval <= 0:
        raise ValueError(f"--monitor-interval must be > 0, got {spec.monitor_interval}")


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """One torchrun invocation under trainwarden."""

    job: str
    """Job name: the rendezvous id, the etcd key component and a metric label."""
    script: list[str]
    """What each worker runs: ``[path, args...]`` or ``["-m", module, args...]``."""
    rdzv_endpoint: str
    """etcd client endpoint, ``host:port``."""
    state_dir: Path
    """The job's state directory (checkpoints, logs, fault markers, incidents)."""
    nproc_per_node: int = 1
    """Workers on this node."""
    nnodes: str = "1"
    """``N`` or ``MIN:MAX`` nodes (elastic)."""
    max_restarts: int = 3
    """Worker-group restarts torchrun may do before the job fails."""
    monitor_interval: float = 0.25
    """Seconds between torchrun's checks of its workers."""
    agent_socket: str | None = None
    """Unix socket of the node agent, passed to workers as ``TRAINWARDEN_AGENT_SOCKET``."""
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    """Extra ``--rdzv-conf`` options (TLS, auth, timeouts)."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """More environment for torchrun and the workers."""
    local_addr: str | None = None
    """Address advertised in the rendezvous (and for the workers' store); None: loopback when the job
    has one node, torchrun's default (the host name) otherwise."""
    warm_dir: str | None = None
    """With a directory: warm workers (runtime/zygote.py), the zygote's socket and pid map in it."""
    auto_instrument: bool = True
    """Instrument the workers with no change to the script (runtime/auto.py): needs ``agent_socket``."""
    tokens_per_step: int = 0
    """Tokens one step processes on one rank, for auto-instrumented scripts' tokens/s (0: steps/s only)."""

    def __post_init__(self) -> None:
        validate_launch(self)


def torchrun_command(spec: LaunchSpec, python: str = sys.executable) -> list[str]:
    cmd = [
        python, "-m", "trainwarden.agent.launch.elastic",  # torchrun, reporting structured events
        *([WARM_ZYGOTE_FLAG] if spec.warm_dir else []),  # which starts the warm workers' zygote first
        "--nnodes", spec.nnodes,
        "--nproc-per-node", str(spec.nproc_per_node),
        "--rdzv-backend", "etcd3",
        "--rdzv-endpoint", spec.rdzv_endpoint,
        "--rdzv-id", spec.job,
        "--max-restarts", str(spec.max_restarts),
        "--monitor-interval", str(spec.monitor_interval),
        "--log-dir", str(torchelastic_log_dir(spec.state_dir)),
    ]
    local_addr = spec.local_addr
    if local_addr is None and parse_nnodes(spec.nnodes)[1] == 1:
        local_addr = "127.0.0.1"
    if local_addr:
        cmd += ["--local-addr", local_addr]
    if spec.rdzv_conf:
        odd = [f"{k}={v}" for k, v in spec.rdzv_conf.items() if any(c in str(v) for c in ",=")]
        if odd:
            raise ValueError(f"torchrun's --rdzv-conf cannot carry {', '.join(odd)}: ',' and '=' separate its "
                             "options; use paths without them")
        cmd += ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in sorted(spec.rdzv_conf.items()))]
    script = list(spec.script)
    if spec.warm_dir:  # each rank's process is the zygote's client; it runs the script in a forked warm worker
        script = ["-m", ZYGOTE_MODULE, *script]
    if script[0] == "-m":
        cmd += ["-m", *script[1:]]
    else:
        cmd += script
    return cmd


def worker_environment(spec: LaunchSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    for key, value in FLIGHT_RECORDER_ENV.items():
        env.setdefault(key, value)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    # torchrun's own INFO lines (rendezvous, restarts) belong in the job's log; `run` learns of restarts from
    # the launcher's structured events (agent/launch/elastic.py), not from these lines
    env.setdefault("LOGLEVEL", "INFO")
    env["PYTHONUNBUFFERED"] = "1"
    env[JOB_ENV] = spec.job
    env[STATE_DIR_ENV] = str(spec.state_dir)
    env.setdefault(CHECKPOINT_DIR_ENV, str(default_checkpoint_dir(spec.state_dir)))
    if spec.agent_socket:
        env[AGENT_SOCKET_ENV] = spec.agent_socket
    if spec.warm_dir:
        env[WARM_SOCKET_ENV], env[WARM_MAP_DIR_ENV] = warm_paths(spec.warm_dir)
    env.update(spec.extra_env)
    if spec.agent_socket and spec.auto_instrument:  # after the user's env: their PYTHONPATH follows ours
        bootstrap = worker_bootstrap_dir()
        env[AUTO_INSTRUMENT_ENV] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (bootstrap, env.get("PYTHONPATH", "")) if p)
        if spec.tokens_per_step:
            env[TOKENS_PER_STEP_ENV] = str(spec.tokens_per_step)
    else:
        env[AUTO_INSTRUMENT_ENV] = "0"
    return env

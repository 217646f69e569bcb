"""What ``trainwarden run`` (agent/launch/run.py) prepares for its workers beyond torchrun's own environment
(agent/launch/torchrun.py): the network interface gloo binds, the numeric policy and the memory tier's settings, a
private torch compile cache, and the warm workers' zygote directory. Each scratch directory is this run's, removed when
it ends, and swept by the next run after a SIGKILL (agent/common/scratch.py).
"""

from __future__ import annotations

import os
import shutil
from contextlib import ExitStack
from typing import Callable, TextIO

from trainwarden.agent.common.netaddr import interface_of
from trainwarden.agent.common.scratch import scratch_dir, sweep
from trainwarden.agent.launch.run_options import RunOptions
from trainwarden.agent.shared.contract import NUMERIC_POLICY_ENV, warm_parent, warm_paths

__all__ = ["INDUCTOR_CACHE_ENV", "compile_cache_env", "network_env", "sweep_killed_runs", "warm_dir"]

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
"""Where torch keeps its compile cache (inductor, triton): a directory of the run unless the user chose one."""


def sweep_killed_runs() -> None:
    """Remove what runs that were killed left on this machine: their private temp directories (``trainwarden-``,
    ``tw-warm-``) and memory snapshots (agent/launch/memory_tier.py). Only directories whose owner process is gone
    go; each run sweeps its own kind as it starts, this is for harnesses that kill whole simulated nodes."""
    from trainwarden.agent.launch.memory_tier import DEFAULT_ROOT, PREFIX

    for prefix in ("trainwarden-", "tw-warm-"):
        sweep(prefix)
    sweep(PREFIX, root=DEFAULT_ROOT)


def network_env(opts: RunOptions, *, memory_tier_env: dict[str, str], address: str | None) -> dict[str, str]:
    """The user's extra environment, the numeric policy, the memory tier's settings, and gloo bound to the interface
    of the advertised ``address`` unless the user chose one (GLOO_SOCKET_IFNAME)."""
    env = dict(opts.extra_env)
    env[NUMERIC_POLICY_ENV] = opts.numeric_policy
    env.update(memory_tier_env)
    if address and "GLOO_SOCKET_IFNAME" not in os.environ and "GLOO_SOCKET_IFNAME" not in env:
        interface = interface_of(address)
        if interface:
            env["GLOO_SOCKET_IFNAME"] = interface
    return env


def compile_cache_env(extra_env: dict[str, str], cleanup: ExitStack) -> dict[str, str]:
    """The workers' torch compile cache in a scratch directory of this run, removed when it ends (swept by the
    next run after a SIGKILL): importing ``torch.distributed.pipelining`` makes ``$TMPDIR/torchinductor_<user>``
    otherwise, which outlives the job. A cache directory the user chose (TORCHINDUCTOR_CACHE_DIR) is kept."""
    if INDUCTOR_CACHE_ENV in os.environ or INDUCTOR_CACHE_ENV in extra_env:
        return {}
    sweep("tw-inductor-")
    cache = scratch_dir("tw-inductor-")
    cleanup.callback(shutil.rmtree, cache, True)
    return {INDUCTOR_CACHE_ENV: str(cache)}


def warm_dir(warm_workers: bool, out: TextIO,
             cleanup: ExitStack) -> tuple[str | None, Callable[[int], int | None] | None]:
    """A short private directory for the warm workers' zygote socket (unix socket paths are short), and what maps a
    warm worker's pid to the client pid it stands behind (agent/shared/contract.py ``warm_parent``); (None, None)
    with cold workers."""
    if not warm_workers:
        print("trainwarden: cold workers: every restarted worker starts a new interpreter (--cold-workers)",
              file=out, flush=True)
        return None, None
    print("trainwarden: warm workers: restarted workers fork from a process with torch and the script's imports "
          "loaded (--cold-workers turns this off)", file=out, flush=True)
    sweep("tw-warm-")
    warm = str(scratch_dir("tw-warm-"))
    cleanup.callback(shutil.rmtree, warm, True)
    workers = warm_paths(warm)[1]
    return warm, lambda pid: warm_parent(pid, workers)

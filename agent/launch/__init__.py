"""What ``trainwarden run`` does on a node: torchrun's command line and environment, the process tree it
starts, the job's output and progress, the run summary and the job's lifecycle in etcd.

``torchrun`` builds the torchrun invocation (``LaunchSpec``), ``process`` owns the running torchrun and every
process it started, ``output`` copies the job's output to the terminal and its log, ``progress`` reads step
lines for scripts that send no telemetry, ``summary`` prints the end-of-run summary, ``run`` puts them
together. It imports ``node`` (the in-process agent), ``incidents``, ``etcd`` and ``common``; only ``cli``
imports it.
"""

from trainwarden.agent.launch.run import RunOptions, run
from trainwarden.agent.launch.torchrun import LaunchSpec, parse_nnodes, torchrun_command, worker_environment

__all__ = ["LaunchSpec", "RunOptions", "parse_nnodes", "run", "torchrun_command", "worker_environment"]

"""What ``trainwarden run`` does on a node: torchrun's command line and environment, the process tree it
starts, the job's output and progress, the run summary and the job's lifecycle in etcd.

``common.preflight`` checks what would fail every worker at once (the script, the fault spec) before anything
starts; ``run_record`` keeps what a run started (``supervisor.json``) so a rerun stops a killed run's
leftovers; ``torchrun`` builds the torchrun invocation (``LaunchSpec``); ``elastic`` is torchrun with a
launcher that reports structured events (round started, failed with which ranks and exit codes,
restarting, finished) which ``events`` reads; ``process`` owns the running torchrun and every process it
started; ``output`` copies the job's output to the terminal and its log; ``progress`` accounts steps,
rounds and restarts from telemetry and those events (step lines in the log only for scripts without the
runtime); ``summary`` prints the end-of-run summary; ``run`` puts them together. It imports ``node`` (the
in-process agent), ``incidents``, ``etcd`` and ``common``; only ``cli`` imports it.
"""

__all__ = ["LaunchSpec", "RunOptions", "parse_nnodes", "run", "torchrun_command", "worker_environment"]

_HOMES = {"RunOptions": "run", "run": "run", "LaunchSpec": "torchrun", "parse_nnodes": "torchrun",
          "torchrun_command": "torchrun", "worker_environment": "torchrun"}


def __getattr__(name: str):
    # imported on first use: torchrun runs ``python -m trainwarden.agent.launch.elastic``, which imports this
    # package first; an eager import of ``run`` would load the whole agent into torchrun (and runpy warns
    # that ``elastic`` was already imported when ``run`` pulls it in)
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f"trainwarden.agent.launch.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

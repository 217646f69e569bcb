"""The node agent: its composition (``agent``), the daemon around it (``daemon``, and ``liveness``: its readiness
and keep-alives to systemd), the actions it takes on workers (``actions``) and where it serves (``endpoints``:
socket, metrics URL, health and status probes); the daemon's job control (``job_runner``, with its copy of the jobs
in etcd ``watched_jobs``, the launchers' records ``launcher_records`` and the node's record ``node_record``).

One agent per node ingests telemetry, exports metrics, samples GPU and host health and runs the watchdog.
Remediation that later acts on the node (cordon, drain, exclusion, the Alertmanager webhook) belongs here.
It imports ``watchdog``, ``metrics``, ``telemetry``, ``incidents``, ``health``, ``etcd`` and ``common``.
"""

from trainwarden.agent.node.agent import AgentConfig, NodeAgent, watchdog_config
from trainwarden.agent.node.endpoints import DEFAULT_SOCKET, AgentUnavailable, check_agent, fetch_status

__all__ = ["DEFAULT_SOCKET", "AgentConfig", "AgentUnavailable", "NodeAgent", "check_agent", "fetch_status",
           "watchdog_config"]

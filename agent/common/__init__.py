"""What every layer of the agent uses: state paths, exit codes, the job lifecycle, stop signals, liveness.

``paths`` (where a job's state lives on disk), ``preflight`` (what would fail every worker at once: checked by
the launcher and by the node daemon), ``exit_codes`` (named exit codes of the CLI), ``job_lifecycle``
(the job's phases and their transition table), ``signals`` (SIGINT/SIGTERM as an event), ``heartbeat`` (a
background loop's proof of life) and ``sdnotify`` (readiness and keep-alives to systemd). It imports only
the shared package (``trainwarden.agent.shared``), so no lower layer ever needs ``launch`` or ``cli``.
"""

from trainwarden.agent.common.heartbeat import Heartbeat
from trainwarden.agent.common.job_lifecycle import IllegalTransition, JobPhase, JobRecord
from trainwarden.agent.common.paths import default_state_home, job_state_dir, validate_job_name
from trainwarden.agent.common.sdnotify import SdNotifier

__all__ = ["Heartbeat", "IllegalTransition", "JobPhase", "JobRecord", "SdNotifier", "default_state_home",
           "job_state_dir", "validate_job_name"]

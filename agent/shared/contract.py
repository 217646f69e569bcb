"""What the runtime (inside workers) and the agent must agree on, beyond the wire format: one place each.

The runtime imports nothing of the agent but this package (``trainwarden.agent.shared``); every fact both
sides use lives here, so no constant is defined twice and a change to one is a change to both. No torch,
no gRPC: plain constants and one name rule.
"""

from __future__ import annotations

import re

__all__ = [
    "AGENT_SOCKET_ENV", "AUTO_INSTRUMENT_ENV", "AUTO_OWNER_ENV", "CHECKPOINT_DIR_ENV", "CHECKPOINT_STAGES", "MEMORY_DIR_ENV",
    "PEER_COPY_ENV",
    "EXIT_ABORTED", "EXIT_NUMERIC_STOP", "EXIT_RESUME_BLOCKED", "NUMERIC_KINDS", "NUMERIC_POLICIES", "NUMERIC_POLICY_ENV",
    "FLIGHT_RECORDER_ENV", "JOB_ENV", "JOB_NAME_RE", "NODE_NAME_RE", "validate_node_name", "MAIN_THREAD_HEADER",
    "PEER_FAILURE_MARKERS", "PEER_FAILURE_TYPES", "PEER_GONE", "peer_credential_socket", "PEER_TOKEN_METADATA", "SERVICE_NAME",
    "STATE_DIR_ENV", "STEP_SOURCES", "TOKENS_PER_STEP_ENV", "WARM_MAP_DIR_ENV", "WARM_SOCKET_ENV", "WARM_WAIT_ENV",
    "WARM_ZYGOTE_PID_ENV", "WARM_PARENT_PID_ENV", "warm_parent", "warm_paths", "ZYGOTE_MODULE",
    "COMMIT_METHOD", "STATUS_METHOD", "STREAM_METHOD", "stacks_file", "trace_file", "validate_job_name",
]

# ---- the gRPC service ----------------------------------------------------------------------------------

SERVICE_NAME = "trainwarden.v1.Telemetry"
"""The telemetry service (agent/shared/telemetry.proto); also the name its health status is kept under."""
STREAM_METHOD = f"/{SERVICE_NAME}/Stream"
STATUS_METHOD = f"/{SERVICE_NAME}/Status"
COMMIT_METHOD = f"/{SERVICE_NAME}/Commit"
CHECKPOINT_RECORD_METHOD = f"/{SERVICE_NAME}/CheckpointRecord"



PEER_TOKEN_METADATA = "trainwarden-peer-token"
"""The gRPC metadata key a worker's stream carries its peer token in, so that the agent knows the stream's uid before
any message (its per-uid limit); the Hello carries the same token for agents that predate it."""


def peer_credential_socket(telemetry_socket: str) -> str:
    """The unix socket beside the telemetry socket where a worker fetches the token that proves its pid
    (agent/telemetry/peer_credentials.py)."""
    return telemetry_socket + ".cred"


# ---- the environment the launcher gives workers ----------------------------------------------------------

AGENT_SOCKET_ENV = "TRAINWARDEN_AGENT_SOCKET"
"""The node agent's unix socket; unset: the runtime's telemetry is a no-op."""
JOB_ENV = "TRAINWARDEN_JOB"
"""The job's name (its rendezvous id, etcd key component and metric label)."""
STATE_DIR_ENV = "TRAINWARDEN_STATE_DIR"
"""The job's state directory on this node (fault markers, diagnostics, incidents)."""
CHECKPOINT_DIR_ENV = "TRAINWARDEN_CHECKPOINT_DIR"
"""The default checkpoint directory of the job."""
MEMORY_DIR_ENV = "TRAINWARDEN_MEMORY_DIR"
"""The node agent's shared-memory directory for the workers' per-step snapshots (agent/shared/snapshot_layout.py);
unset: no memory snapshots."""
PEER_COPY_ENV = "TRAINWARDEN_PEER_COPY"
"""``0``: the workers do not copy their memory snapshots to the next node (runtime/checkpoint/memory_peer.py); on by default
when the job spans nodes and every rank keeps snapshots."""
FLUSH_INTERVAL_S = 0.5
"""How often a worker sends what it queued (the runtime's ``ClientConfig.flush_interval_s``): a step or a
collective reaches the agent up to this late."""
MAX_STEP_SEND_S = 10.0
"""The longest a worker holds its steps back while they keep ending (``ReadPace.step_send_seconds``, capped here by
the worker; a batch promising more is invalid to the agent): runtime/send_pace.py."""
STEPS_STOPPED_AFTER_S = 0.75
"""A worker holding its steps back (runtime/send_pace.py) counts them stopped once none ended for this long, or
1.5 of their recent intervals if longer, and then sends what it held at its next look: the newest step reaches the
agent up to that long plus a flush after it ended (agent/watchdog/read_pace.py ``step_report_s``)."""
FR_READ_INTERVAL_S = 1.5
"""The longest period between a worker's Flight Recorder reads until the agent asks for another
(``ClientConfig.fr_interval_s``): collectives are reported only by those reads, so a job whose only heartbeat is
its collectives is heard from this rarely (plus the flush) however often it runs them."""
FLIGHT_RECORDER_ENV = {
    # keep a ring buffer of the last collectives in every process group (gloo and NCCL); every read dumps
    # the whole ring, so it stays small: ~1 s of the reference job's collectives, read about once a second
    # (runtime/flight_recorder.py, ReadSchedule)
    "TORCH_FR_BUFFER_SIZE": "256",
    # GPU start/end times of NCCL collectives (ignored by gloo)
    "TORCH_NCCL_ENABLE_TIMING": "1",
}
"""Set for every worker (without overriding the user's values) so the Flight Recorder records collectives."""
AUTO_INSTRUMENT_ENV = "TRAINWARDEN_AUTO_INSTRUMENT"
"""``1``: the worker instruments itself when its process group is created, with no change to the script
(runtime/auto.py, started from the ``sitecustomize`` the launcher puts first on PYTHONPATH); ``0``: it does
not."""
AUTO_OWNER_ENV = "TRAINWARDEN_AUTO_PID"
"""Set by an auto-instrumented worker in its own environment: a process started from it (a spawned
DataLoader worker, a subprocess) inherits it with another pid and stays quiet."""
TOKENS_PER_STEP_ENV = "TRAINWARDEN_TOKENS_PER_STEP"
"""Tokens one step of an auto-instrumented script processes (job-wide per rank: tokens/s are reported only
when it is set; steps/s always)."""
STEP_SOURCES = ("rt.step", "optimizer hooks")
"""Where a worker's steps come from (its Hello's ``step_source``): the script's own ``rt.step``, or the
optimizer hooks of auto-instrumentation. A job with collectives and no step at all is "collectives only"."""

NUMERIC_POLICY_ENV = "TRAINWARDEN_NUMERIC_POLICY"
"""What a worker's numeric guard does with a non-finite loss or gradient (``trainwarden run --numeric-policy``)."""
NUMERIC_POLICIES = ("rollback", "stop", "alert")
"""``rollback`` (the default): every rank skips the step's update, so the state is the one before it and the step's
batch is not trained on; ``stop``: the job stops with the evidence; ``alert``: an incident only, the update applies."""
NUMERIC_KINDS = ("nan", "loss_spike", "sdc")
"""What a worker's Numeric record reports: a non-finite loss or gradient, a loss far out of its recent range, or a
rank whose recomputed gradient differs bitwise from its replicas' (silent data corruption: runtime/sdc_check.py)."""

# ---- how a worker leaves ------------------------------------------------------------------------------

EXIT_ABORTED = 75
"""A worker exits with this code when the agent aborts it (hang recovery); torchrun restarts it."""
EXIT_RESUME_BLOCKED = 76
"""A worker exits with this code when its job may not resume: checkpoints exist (or were committed) but none
can be read or loaded. The launcher stops the job at once, without spending a restart: a restart would meet
the same checkpoints (runtime/checkpoint/checkpointer.py, ``CheckpointUnloadableError``)."""
EXIT_NUMERIC_STOP = 77
"""A worker exits with this code when its training computed non-finite values and the numeric policy says stop (the
``stop`` policy, or a NaN that came back after a rollback): the launcher stops the job without a restart, which
would only compute them again (runtime/numeric.py, ``NumericStop``)."""
PEER_GONE = "peer gone"
"""How a worker's goodbye reason starts when it left because another rank had failed
(``trainwarden.runtime.goodbye("peer gone: ...")``): crash attribution then looks past it."""
PEER_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Connection refused",
    "Broken pipe",
    "NCCL communicator was aborted",
    "remote process exited",
)
"""Text of the errors a rank's collectives raise when a peer rank died (gloo, NCCL): the runtime recognises
its own exception by them (runtime/peer_failure.py), the agent a worker's error file."""
PEER_FAILURE_TYPES = ("DistNetworkError", "DistBackendError", "DistStoreError")
"""torch's exception types for the same."""

CHECKPOINT_STAGES = ("save_start", "staged", "written", "committed", "restore_start", "restored", "failed", "set_aside",
                     "held", "resume_blocked", "snapshot")
"""Checkpoint stages a worker reports, in the order of a save and of a restore (proto enum CheckpointStage
has the same names, upper-case). ``snapshot``: a rank's in-memory snapshot of a step is written (its path says
which; agent/shared/snapshot_layout.py); it is not a stage of the disk checkpoint and does not change the rank's.
``written``: every rank's own part of a save is on disk (its background write ended; rank 0 then commits): the
watchdog keeps the steps that overlapped a write out of the step time a hang's deadline follows."""

# ---- diagnostics a worker writes on the agent's request -------------------------------------------------

MAIN_THREAD_HEADER = "# trainwarden main_thread=0x{ident:016x}"
"""First line of a stacks file: names the training thread among faulthandler's "Thread 0x..." blocks."""


def stacks_file(rank: int) -> str:
    """File name of a rank's faulthandler stacks in a diagnostics directory."""
    return f"rank{rank}.stacks"


def trace_file(rank: int) -> str:
    """File name of a rank's Flight Recorder dump in a diagnostics directory."""
    return f"rank{rank}.fr"


# ---- job names -------------------------------------------------------------------------------------------

JOB_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")


def validate_job_name(name: str) -> str:
    """Job names become etcd keys, directory names and metric labels: keep them tame (ValueError if not)."""
    if not isinstance(name, str) or not JOB_NAME_RE.match(name):
        raise ValueError(
            f"job name {name!r} is invalid: use 1-63 lowercase letters, digits, '.', '_' or '-', "
            "starting and ending with a letter or digit"
        )
    return name


NODE_NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")


def validate_node_name(name: str) -> str:
    """Node names (host names by default) become etcd keys and metric labels (ValueError if unfit)."""
    if not isinstance(name, str) or not NODE_NAME_RE.match(name):
        raise ValueError(f"node name {name!r} is invalid: use letters, digits, '.', '_' or '-' (at most 253), "
                         "starting and ending with a letter or digit")
    return name


# ---- warm workers (runtime/zygote.py; the launcher starts the zygote, the agent reads its pid map) ----------

ZYGOTE_MODULE = "trainwarden.runtime.zygote"
"""``python -m`` this: with ``--serve SOCKET MAP_DIR SCRIPT...`` the zygote, else the client torch's agent starts
per rank in place of the script."""
WARM_SOCKET_ENV = "TRAINWARDEN_WARM_SOCKET"
WARM_MAP_DIR_ENV = "TRAINWARDEN_WARM_MAP_DIR"
WARM_ZYGOTE_PID_ENV = "TRAINWARDEN_WARM_ZYGOTE_PID"
"""The zygote's pid (set by the launcher that started it): a client waits for its socket only while it lives."""
WARM_WAIT_ENV = "TRAINWARDEN_WARM_WAIT_S"
WARM_PARENT_PID_ENV = "TRAINWARDEN_WARM_PARENT_PID"
"""The launcher's pid, for the zygote it starts: a launcher killed before the zygote asked for its parent-death
signal left the zygote orphaned, importing on and then serving forever (it re-made a swept warm directory)."""


def warm_paths(warm_dir: str) -> tuple[str, str]:
    """The zygote's socket and its pid map directory inside a run's private warm directory."""
    return f"{warm_dir}/zygote.sock", f"{warm_dir}/workers"


def warm_parent(pid: int, map_dir: str | None) -> int | None:
    """The client pid a warm worker stands behind (None: not a warm worker): the zygote writes
    ``<map dir>/<worker pid>`` holding it."""
    if not map_dir:
        return None
    try:
        with open(f"{map_dir}/{int(pid)}") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None

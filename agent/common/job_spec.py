"""A job as an operator submits it (`trainwarden submit JOB.toml`), and the TOML reader the daemon's config
shares with it.

    name = "gpt-small"
    command = ["-m", "trainwarden.runtime.examples.gpt", "--tp", "2", "--steps", "2000"]
    nnodes = "2:4"            # MIN:MAX, or N
    spare_nodes = 0           # optional: hot spares beyond N (nnodes N or M:N); a spare takes a lost node's ranks
    nproc_per_node = 8
    checkpoint_dir = "/shared/ckpt/gpt-small"   # optional: the launcher's default otherwise
    max_restarts = 3          # optional: worker-group restarts before the job fails
    straggler_policy = "alert"                  # optional: alert or exclude
    link_policy = "alert"     # optional: alert, or exclude (a node a link check names slow leaves the job)
    numeric_policy = "rollback"                 # optional: rollback, stop or alert (a NaN loss or gradient)
    rendezvous_round = "native"                 # optional: native (default) or dynamic (torch's)
    hang_floor_s = 1.5        # optional: seconds without a step, collective, CPU or I/O that count as a hang
    nodes = ["gpu-a1", "gpu-a2", "gpu-a3"]      # optional: the nodes that may run it (default: any)
    auto_instrument = true    # optional: instrument the unchanged script (default true)
    tokens_per_step = 524288  # optional: tokens one step processes on one rank (tokens/s; default: steps/s)
    model_params = 1.3e9      # optional, for the MFU: 6 FLOPs per parameter and token (or flops_per_step)
    peak_tflops = 989         # optional: one accelerator's peak (default: known GPUs by their NVML name)

    [env]                     # optional: more environment for the workers
    OMP_NUM_THREADS = "4"

``env`` may not set what trainwarden or torchrun sets for the job (``reserved_env_problem``): a spec reached the
workers after trainwarden's own variables, so it could point them at another agent socket, speak as another job
or rank, or notify systemd as the daemon. A relative ``checkpoint_dir`` (each node would resolve it against its
launcher's working directory) and a ``nodes`` list shorter than the minimum of ``nnodes`` (the job could never
gather) are refused too.

Every problem is a ``JobSpecError`` that names the file and the field: a missing or unknown field (with the
closest known name), a wrong type, a value out of range. Nothing is submitted unless the whole spec is valid.

**One contract.** ``parse_job_spec`` is the only validation: `submit`, `submit --check` and the daemon's reading of
the record in etcd (``JobSpec.from_json``) all run it, against one schema (``_FIELDS``). A field is either required
(``name``, ``command``) or optional everywhere, and null for an optional field means its default, so whatever
`submit` accepts the daemon accepts. ``to_json`` leaves out what is None (a daemon of an earlier release reads it).
"""

from __future__ import annotations

import difflib
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from trainwarden.agent.common.launch_options import (HANG_FLOOR_RANGE_S, LAUNCH_OPTIONS, MAX_NODES, OPTIONS,
                                                    cross_problems, hang_floor_problem, launcher_flags, parse_nnodes,
                                                    spares_problem)
from trainwarden.agent.shared.contract import CHECKPOINT_DIR_ENV, JOB_ENV, validate_job_name, validate_node_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["BOUNDS", "HANG_FLOOR_RANGE_S", "JOB_ENV_ALLOWED", "MAX_STRING", "JobSpec", "JobSpecError", "OPTIONAL_FIELDS",
           "STRAGGLER_POLICIES", "SUBMISSION_KEYS", "hang_floor_problem", "load_job_spec", "parse_job_spec",
           "parse_nnodes", "read_toml", "reserved_env_problem", "spares_problem", "string_problem",
           "unknown_key_message"]

STRAGGLER_POLICIES = OPTIONS["straggler_policy"].choices

BOUNDS = {**{o.name: int(o.most) for o in LAUNCH_OPTIONS if o.kind is int and o.most is not None},
          "nnodes": MAX_NODES, "command": 4096, "env": 1024, "nodes": 100_000}
"""The largest value a spec may give each of these fields (for lists and tables, the most entries): past them a
number is a typo or an attack (``nproc_per_node = 1e9`` would have the launcher start a billion workers), never a job.
The launch options' bounds are declared with them (agent/common/launch_options.py); ``hang_floor_s`` has a range."""
MAX_STRING = 64 * 1024
"""The longest string a spec may hold (an argument, an env value, a path)."""


def string_problem(value: str) -> str | None:
    """Why ``value`` may not be a string in a spec (a control character, NUL included, or past ``MAX_STRING``), or
    None. A NUL cannot reach ``execve`` at all (the launch would fail on every node, every round); a newline or an
    escape sequence forges log lines and terminal output."""
    if len(value) > MAX_STRING:
        return f"is {len(value)} characters long; at most {MAX_STRING} are accepted"
    for index, char in enumerate(value):
        if ord(char) < 0x20 or 0x7F <= ord(char) <= 0x9F:
            return f"holds the control character {char!r} at position {index}; remove it"
    return None


SUBMISSION_KEYS = ("managed", "submitted_by", "submitted_at")
"""What `submit` adds to the spec's fields in ``jobs/<job>/spec`` (agent/etcd/jobs.py); not part of the spec."""

_TORCHRUN_ENV = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                           "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
"""What torchrun's agent sets for each worker (torch.distributed.elastic's LocalElasticAgent), with TORCHELASTIC_*."""
JOB_ENV_ALLOWED = frozenset({"TRAINWARDEN_FAULTS", "TRAINWARDEN_TIMINGS", "TRAINWARDEN_FR_MAX_DUTY",
                             "TRAINWARDEN_CKPT_READ_BACKOFF_S"})
"""The TRAINWARDEN_* variables a spec may set: the workers read them and trainwarden never sets them (fault
injection, start-up timings, the Flight Recorder's duty, checkpoint read backoff; runtime/); every other
TRAINWARDEN_* name is trainwarden's, today's and tomorrow's."""


def reserved_env_problem(key: str) -> str | None:
    """Why a job's ``env`` may not set ``key`` (trainwarden or torchrun sets it for the job), or None."""
    if key in JOB_ENV_ALLOWED:
        return None
    if key == CHECKPOINT_DIR_ENV:
        return "is set by trainwarden for every job; use the field 'checkpoint_dir'"
    if key == JOB_ENV:
        return "is set by trainwarden for every job; the job's name is the field 'name'"
    if key.startswith("TRAINWARDEN_"):
        return ("is trainwarden's: it sets its TRAINWARDEN_* variables for every job (the agent socket, the job, "
                f"its directories); only {', '.join(sorted(JOB_ENV_ALLOWED))} are the job's to set")
    if key in _TORCHRUN_ENV or key.startswith("TORCHELASTIC_"):
        return "is the rendezvous's: torchrun sets it for each worker"
    if key == "NOTIFY_SOCKET":
        return "is the daemon's systemd notification socket: a job must not speak for the daemon"
    return None


class JobSpecError(ValueError):
    """A job spec (or a config file) that cannot be used: what is wrong, where, and what to do."""


@dataclass(frozen=True)
class JobSpec:
    """A submitted job: what every node's daemon needs to launch its part."""

    name: str
    command: tuple[str, ...]
    """The worker command: a script path and its arguments, or ``-m``, a module and its arguments."""
    nnodes: str = "1"
    spare_nodes: int = 0
    """Hot spare nodes beyond ``nnodes``'s N (M:N: with none left the job shrinks to M): ``--spare-nodes``."""
    nproc_per_node: int = 1
    checkpoint_dir: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    max_restarts: int = 3
    straggler_policy: str = "alert"
    link_policy: str = "alert"
    """``exclude``: a node whose link a link check names slow leaves the job and is cordoned (``--link-policy``)."""
    numeric_policy: str = "rollback"
    """What the workers do with a non-finite loss or gradient: ``rollback``, ``stop`` or ``alert``
    (``--numeric-policy``; runtime/numeric.py)."""
    nodes: tuple[str, ...] = ()
    """The nodes that may run the job; empty: any node."""
    warm_workers: bool = True
    """Restarted workers fork from a process with torch imported (runtime/zygote.py); false:
    ``trainwarden run --cold-workers``."""
    memory_snapshots: bool = True
    """The workers' per-step snapshots kept in shared memory across restarts; false: ``--no-memory-snapshots``."""
    rendezvous_round: str = "native"
    """``native`` (a key per node, one closing transaction) or ``dynamic`` (torch's): ``--rendezvous-round``."""
    hang_floor_s: float | None = None
    """The hang deadline's floor (``--hang-floor``); None: the watchdog's default."""
    auto_instrument: bool = True
    tokens_per_step: int = 0
    flops_per_step: float = 0.0
    """The model's FLOPs per training step, all ranks together, for the MFU (``--flops-per-step``)."""
    model_params: float = 0.0
    """Or its parameter count (``--model-params``): 6 FLOPs per parameter and token."""
    peak_tflops: float = 0.0
    """One accelerator's peak for the MFU (``--peak-tflops``); 0: from the GPU's NVML name."""
    auto_resume: bool = True
    """Whether an alert may resume the job once it failed (the daemon's Alertmanager webhook); false: only an
    operator's `trainwarden resume` does."""
    user: str | int | None = None
    """Who the daemon runs the job as: a user name or uid on the nodes (agent/node/job_user.py); None: the node's
    ``job_user``."""

    def targets(self, node: str) -> bool:
        return not self.nodes or node in self.nodes

    def to_json(self) -> dict[str, Any]:
        """The spec's fields as ``parse_job_spec`` reads them back; a field that is None is left out."""
        data = asdict(self)
        data["command"], data["nodes"], data["env"] = list(self.command), list(self.nodes), dict(self.env)
        return {key: value for key, value in data.items() if value is not None}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "etcd") -> "JobSpec":
        """The spec in a stored record: ``SUBMISSION_KEYS`` set aside, every other key validated (an unknown one
        is refused, never ignored: a field this release does not know could be one it must honour)."""
        return parse_job_spec({k: v for k, v in data.items() if k not in SUBMISSION_KEYS}, source)

    def launcher_args(self) -> list[str]:
        """``trainwarden run`` arguments for this job (the node-specific ones are the caller's): the launch options
        that differ from their defaults, as the declaration spells them (``launcher_flags``)."""
        args = ["--job", self.name, *launcher_flags({o.name: getattr(self, o.name) for o in LAUNCH_OPTIONS})]
        env = dict(self.env)
        if self.checkpoint_dir:  # the workers' TRAINWARDEN_CHECKPOINT_DIR (the reference job's --ckpt-dir default)
            env.setdefault(CHECKPOINT_DIR_ENV, self.checkpoint_dir)
        for key, value in sorted(env.items()):
            args += ["--env", f"{key}={value}"]
        return [*args, "--", *self.command]


_FIELDS = {"name": str, "command": list, "checkpoint_dir": str, "env": dict, "nodes": list, "auto_resume": bool,
           "user": (str, int), **{option.name: option.spec_type for option in LAUNCH_OPTIONS}}
"""Every field and the types it may hold: the job's own, and the launch options as declared once
(agent/common/launch_options.py)."""
_REQUIRED = ("name", "command")
OPTIONAL_FIELDS = tuple(sorted(set(_FIELDS) - set(_REQUIRED)))
"""Fields that may be left out, or given as null: their default applies."""
_TYPE_NAMES = {str: "a string", list: "a list", int: "a whole number", dict: "a table", (str, int): "a string",
               bool: "true or false", (int, float): "a number"}


def unknown_key_message(key: str, known, source: str) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{source}: unknown field {key!r}{hint}; known fields: {', '.join(sorted(known))}"


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """A TOML file's table; ``JobSpecError`` naming the file when it cannot be read or parsed."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise JobSpecError(f"{path}: no such {what} file") from None
    except OSError as exc:
        raise JobSpecError(f"{path}: cannot read the {what}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise JobSpecError(f"{path}: not valid TOML: {exc}") from None


def load_job_spec(path: str | Path) -> JobSpec:
    return parse_job_spec(read_toml(path, "job spec"), str(path))


def parse_job_spec(data: Mapping[str, Any], source: str) -> JobSpec:
    """The JobSpec ``data`` describes; ``JobSpecError`` naming ``source`` and the field otherwise."""
    data = _present_and_typed(data, source)

    def fail(key: str, why: str) -> JobSpecError:
        return JobSpecError(f"{source}: field {key!r} {why}")

    launch = {}
    for option in LAUNCH_OPTIONS:  # each checked as its declaration says, in the same words as the flag's
        value = option.read(data.get(option.name, option.default))
        if (why := option.problem(value)) is not None:
            raise fail(option.name, why)
        launch[option.name] = value
    for why in cross_problems(launch, lambda name: repr(name)):
        raise JobSpecError(f"{source}: field {why}")
    try:
        name = validate_job_name(data["name"])
    except ValueError as exc:
        raise fail("name", f"is not a job name: {exc}") from None
    command = data["command"]
    if not command or not all(isinstance(part, str) and part for part in command):
        raise fail("command", "must be a non-empty list of non-empty strings, e.g. [\"train.py\", \"--lr\", \"3e-4\"] "
                              "or [\"-m\", \"my.module\"]")
    if command[0] == "-m" and len(command) < 2:
        raise fail("command", "names no module after \"-m\"")
    env = data.get("env", {})
    for key, value in env.items():
        if not key or "=" in key or not isinstance(value, str):
            raise fail("env", f"entry {key!r} must map a variable name (no '=') to a string, got {value!r}")
        why = reserved_env_problem(key)
        if why is not None:
            raise fail("env", f"entry {key!r} {why}; remove it from [env]")
    nodes = _nodes(data.get("nodes", []), launch["nnodes"], fail)
    checkpoint_dir = data.get("checkpoint_dir")
    if checkpoint_dir is not None and not checkpoint_dir:
        raise fail("checkpoint_dir", "is empty; leave it out for the launcher's default")
    if checkpoint_dir is not None and not checkpoint_dir.startswith("/"):
        raise fail("checkpoint_dir", f"{checkpoint_dir!r} is relative: each node would resolve it against its "
                                     "launcher's working directory; give an absolute path (e.g. /shared/ckpt/<job>)")
    user = data.get("user")
    if isinstance(user, int) and user < 0:
        raise fail("user", f"must be a user name or a uid of 0 or more, got {user}")
    if isinstance(user, str) and (not user or any(c.isspace() or c in ":/" for c in user)):
        raise fail("user", f"{user!r} is not a user name (e.g. \"alice\" or a uid such as 1000)")
    return JobSpec(name=name, command=tuple(command), checkpoint_dir=checkpoint_dir, env=dict(env), nodes=nodes,
                   auto_resume=data.get("auto_resume", True), user=user, **launch)


def _present_and_typed(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``data`` without its nulls (a null is the field's default), once every key is known, the required ones are
    there, every value has its field's type and no string or list is past its bound."""
    for key in data:
        if key not in _FIELDS:
            raise JobSpecError(unknown_key_message(key, _FIELDS, source))
    data = {key: value for key, value in data.items() if value is not None}
    for key in _REQUIRED:
        if key not in data:
            raise JobSpecError(f"{source}: field {key!r} is missing; a job needs at least 'name' and 'command'")

    def fail(key: str, why: str) -> JobSpecError:
        return JobSpecError(f"{source}: field {key!r} {why}")

    for key, value in data.items():
        kinds = _FIELDS[key]
        if (kinds is not bool and isinstance(value, bool)) or not isinstance(value, kinds):
            raise fail(key, f"must be {_TYPE_NAMES[kinds]}, got {type(value).__name__} {value!r}")
        _check_strings(key, value, fail)
        bound = BOUNDS.get(key)
        if bound is not None and isinstance(value, (list, dict)) and len(value) > bound:
            raise fail(key, f"has {len(value)} entries; at most {bound} are accepted")
    return data


def _nodes(nodes: list, nnodes: str, fail) -> tuple[str, ...]:
    """The spec's ``nodes``, each a node name, and enough of them for ``nnodes``'s minimum."""
    for node in nodes:
        try:
            validate_node_name(node if isinstance(node, str) else repr(node))
        except ValueError as exc:
            raise fail("nodes", f"entry {node!r} is not a node name: {exc}") from None
    least, named = parse_nnodes(nnodes)[0], len(set(nodes))
    if nodes and named < least:
        raise fail("nodes", f"names {named} node{'s' if named != 1 else ''} but nnodes {nnodes!r} needs at "
                            f"least {least}: the job could never gather; name more nodes, lower nnodes, or leave "
                            "'nodes' out (any node)")
    return tuple(nodes)


def _check_strings(key: str, value: Any, fail) -> None:
    """``string_problem`` of every string in field ``key`` (a list's entries, a table's keys and values)."""
    if isinstance(value, str):
        if (why := string_problem(value)) is not None:
            raise fail(key, why)
    elif isinstance(value, list):
        for index, entry in enumerate(value):
            if isinstance(entry, str) and (why := string_problem(entry)) is not None:
                raise fail(key, f"entry {index} {why}")
    elif isinstance(value, dict):
        for name, entry in value.items():
            for what, text in (("name", name), ("value", entry)):
                if isinstance(text, str) and (why := string_problem(text)) is not None:
                    raise fail(key, f"entry {name!r}: its {what} {why}")


def dumps(spec: JobSpec) -> str:
    return json.dumps(spec.to_json(), sort_keys=True)

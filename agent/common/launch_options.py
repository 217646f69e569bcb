"""A launch's options, each declared once: ``LAUNCH_OPTIONS``.

A job's launch can be described four ways: `trainwarden run`'s flags (agent/cli/run.py), its ``RunOptions``
(agent/launch/run.py), a submitted job's spec (``JobSpec``, agent/common/job_spec.py, from TOML or from its record
in etcd) and the flags the node daemon gives the job's launcher (``JobSpec.launcher_args``). A few of them are also
settings of the node agent (``straggler_policy``, ``hang_floor``: agent/cli/agent.py). Each option below says once
what it is called in each (``name`` is the spec field and the ``RunOptions`` attribute, ``flag`` the command line,
``setting`` the agent's configuration key and ``TRAINWARDEN_<SETTING>`` variable), its type, default, bounds and
help, and every surface is derived from it:

- `trainwarden run`'s argparse flags: ``add_arguments``;
- the spec's field types and the check of each value: ``spec_type`` and ``Option.problem``;
- ``RunOptions``'s check of each value: ``Option.problem`` again, the same words after the flag's name;
- the launcher's flags for a spec: ``launcher_flags``, which `trainwarden run` parses back to the same values
  (tests/unit/test_launch_options.py holds every surface to the declaration).

Rules between two options (hot spares need nodes; a step's cost given twice) are functions here too
(``cross_problems``), called by both the spec and ``RunOptions``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from trainwarden.agent.shared.contract import NUMERIC_POLICIES

__all__ = ["LAUNCH_OPTIONS", "OPTIONS", "Option", "add_argument", "add_arguments", "cross_problems", "launcher_flags",
           "nnodes_problem", "parse_nnodes"]

MAX_NODES = 100_000
"""The most nodes a job may name (``nnodes``'s MAX plus ``spare_nodes``): past it a number is a typo, never a job."""
HANG_FLOOR_RANGE_S = (0.5, 180.0)
"""What ``--hang-floor`` and ``hang_floor_s`` accept: at least the runtime's telemetry period (0.5 s), and not
above the watchdog's checkpoint allowance (``HangConfig.checkpoint_s``, 180 s), which a larger floor would override
(tests/unit/test_launch_options.py checks the two agree)."""


def nnodes_problem(value: str) -> str | None:
    """Why ``value`` is not ``N`` or ``MIN:MAX`` nodes with 1 <= MIN <= MAX <= ``MAX_NODES``, or None."""
    parts = str(value).split(":")
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        return f"{value!r}: expected N or MIN:MAX with integers, e.g. 1 or 1:4"
    if len(numbers) == 1:
        numbers = numbers * 2
    if len(numbers) != 2 or not 1 <= numbers[0] <= numbers[1]:
        return f"{value!r}: expected N or MIN:MAX with 1 <= MIN <= MAX"
    if numbers[1] > MAX_NODES:
        return f"{value!r}: at most {MAX_NODES} nodes are accepted"
    return None


def parse_nnodes(value: str) -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` -> (min, max); a ValueError naming ``--nnodes`` otherwise."""
    if (why := nnodes_problem(value)) is not None:
        raise ValueError(f"--nnodes {why}")
    low, _, high = str(value).partition(":")
    return int(low), int(high or low)


def hang_floor_problem(seconds: float) -> str | None:
    """Why ``seconds`` is not a hang floor (``HANG_FLOOR_RANGE_S``), or None."""
    low, high = HANG_FLOOR_RANGE_S
    return None if low <= seconds <= high else f"must be seconds between {low:g} and {high:g}, got {seconds!r}"


@dataclass(frozen=True)
class Option:
    """One launch option; see the module's docstring for where each part is used."""

    name: str
    """The spec's field and the ``RunOptions`` (and ``JobSpec``) attribute."""
    kind: type
    """``int``, ``float``, ``str`` or ``bool``: what the value is once read."""
    default: Any
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    least: float | None = None
    """The smallest value accepted (numbers)."""
    most: float | None = None
    """The largest value accepted (numbers): past it a value is a typo or an attack, never a job."""
    check: Callable[[Any], str | None] | None = None
    """A check of its own (``nnodes``'s form, the hang floor's range), after the type."""
    flag_name: str | None = None
    """The command line's name when it is not the field's with dashes (``--hang-floor`` for ``hang_floor_s``)."""
    off_flag: str | None = None
    """For a boolean that is on by default: the flag that turns it off (``--cold-workers``)."""
    on_flag: str | None = None
    """And the flag that says the default out loud, kept for scripts of earlier releases (``--warm-workers``)."""
    setting: str | None = None
    """The node agent's configuration key for the same thing (its variable is ``TRAINWARDEN_<SETTING>``)."""

    @property
    def flag(self) -> str:
        return self.flag_name or "--" + self.name.replace("_", "-")

    @property
    def spec_type(self) -> type | tuple[type, ...]:
        """What a spec (TOML or JSON) may hold for it: a whole number where a float is asked for, a bare number for
        ``nnodes``."""
        if self.kind is float:
            return (int, float)
        if self.check is nnodes_problem:
            return (str, int)
        return self.kind

    def read(self, value: Any) -> Any:
        """``value`` as the option's kind (a spec's ``nnodes = 2`` is ``"2"``, its ``hang_floor_s = 8`` is 8.0)."""
        if value is None or self.kind is bool:
            return value
        return self.kind(value)

    def problem(self, value: Any) -> str | None:
        """Why ``value`` (already of the option's kind, or None where the default is None) is not accepted, or
        None. The words follow the option's name: "must be at least 1, got 0"."""
        if value is None:
            return None if self.default is None else "may not be empty"
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}, got {value!r}"
        if self.kind is float and self.least == 0 and (not value >= 0 or math.isinf(value)):
            return f"must be a finite number of 0 or more, got {value!r}"
        if self.least is not None and value < self.least:
            return (f"must be 0 or more, got {value}" if self.least == 0 else
                    f"must be at least {self.kind(self.least)}, got {value}")
        if self.most is not None and value > self.most:
            return f"must be at most {self.kind(self.most)}, got {value}"
        return self.check(value) if self.check is not None else None


LAUNCH_OPTIONS: tuple[Option, ...] = (
    Option("nnodes", str, "1", "nodes, N or MIN:MAX (default 1)", metavar="MIN:MAX", check=nnodes_problem),
    Option("nproc_per_node", int, 1, "workers on this node (default 1)", metavar="N", least=1, most=1024),
    Option("spare_nodes", int, 0,
           "hot spares (--nnodes MIN:N, N >= 2): start N+K nodes; N train, K wait in the rendezvous with their imports "
           "loaded, and when a training node is lost a spare takes its ranks in the next round, so the world size stays "
           "N; with none left the job shrinks to MIN or more (default 0: the job shrinks at once)",
           metavar="K"),  # checked with nnodes: spares_problem
    Option("max_restarts", int, 3, "worker-group restarts before the job fails (default 3)", metavar="K",
           least=0, most=1000),
    Option("straggler_policy", str, "alert",
           "on a straggler: alert (flag, metric, incident; default) or exclude (also ask for this node's exclusion at "
           "the job's next rendezvous: jobs/<job>/exclude/<node>)",
           choices=("alert", "exclude"), setting="straggler_policy"),
    Option("link_policy", str, "alert",
           "on a communication regression whose link check names this node's link slow: alert (incident with the "
           "link check's report; default) or exclude (also leave the job at a step boundary after a checkpoint, the "
           "others go on, and cordon the node)",
           choices=("alert", "exclude")),
    Option("numeric_policy", str, "rollback",
           "on a step whose loss or gradients are not finite (NaN, Inf), as the workers' numeric guard sees it (the "
           "reference job's; runtime/numeric.py for your own loop): rollback (default: every rank skips the step's "
           "update and its batch, training goes on; NaN again within 10 steps stops the job), stop (the job stops "
           "with the evidence, no restart), or alert (an incident only)",
           choices=tuple(NUMERIC_POLICIES)),
    Option("rendezvous_round", str, "native",
           "native (the default): each node joins with a key of its own and one transaction closes the round, which "
           "scales to thousands of nodes; dynamic: torch's dynamic rendezvous over etcd (every join a compare-and-set "
           "on one shared record; 128 nodes did not gather in 9 minutes)",
           choices=("native", "dynamic")),
    Option("hang_floor_s", float, None,
           "shortest time without a step, a collective, CPU or I/O on any rank before the job counts as hung and is "
           "restarted (default 1.5; the deadline is otherwise 5x the p99 step time). Raise it for a script that "
           "sleeps between steps",
           metavar="S", check=hang_floor_problem, flag_name="--hang-floor", setting="hang_floor"),
    Option("warm_workers", bool, True,
           "start every restarted worker as a new interpreter, as plain torchrun does (by default restarted workers "
           "fork from a process that has torch and the script's imports loaded: a restart skips the interpreters' "
           "start-up; the first round starts cold)",
           off_flag="--cold-workers", on_flag="--warm-workers"),
    Option("memory_snapshots", bool, True,
           "keep no per-step snapshots in shared memory (by default a job that checkpoints with trainwarden's "
           "Checkpointer and calls its snapshot() every step restarts from the step before a crash or a hang, from "
           "memory; on several nodes each snapshot is also copied to the next node, so a node loss resumes from "
           "memory too: TRAINWARDEN_PEER_COPY=0 turns that off)",
           off_flag="--no-memory-snapshots"),
    Option("auto_instrument", bool, True,
           "do not instrument the script by itself: without it, a script that never imports trainwarden gets step "
           "times (one step per optimizer.step()), collective timing, hang and straggler detection; scripts that "
           "call rt.step report their own steps either way",
           off_flag="--no-auto-instrument"),
    Option("tokens_per_step", int, 0,
           "tokens one step processes on one rank: an auto-instrumented script's tokens/s (default: steps/s only)",
           metavar="N", least=0, most=2**40),
    Option("flops_per_step", float, 0.0,
           "the model's FLOPs per training step, all ranks together (forward and backward): exports "
           "trainwarden_mfu_ratio and prints the MFU in the summary",
           metavar="F", least=0),
    Option("model_params", float, 0.0, "or the model's parameter count: a step costs 6*N FLOPs per token the ranks "
                                       "report", metavar="N", least=0),
    Option("peak_tflops", float, 0.0,
           "one accelerator's peak TFLOPS for the MFU (default: known GPUs by their NVML name; none on CPU)",
           metavar="T", least=0),
)
OPTIONS: Mapping[str, Option] = {option.name: option for option in LAUNCH_OPTIONS}


def spares_problem(nnodes: str, spare_nodes: int, *, names: tuple[str, str] = ("--spare-nodes", "--nnodes")
                   ) -> str | None:
    """Why ``spare_nodes`` hot spares cannot go with ``nnodes`` (``names``: how the two are called where they were
    given), or None. With ``nnodes`` M:N a round takes N training nodes when it can and the spares wait behind it;
    a spare replaces a lost node at the same world size, and with no spare left the job shrinks to M or more, as it
    would without spares (M == N: it waits)."""
    spares, size = names
    if isinstance(spare_nodes, bool) or not isinstance(spare_nodes, int) or spare_nodes < 0:
        return f"{spares} {spare_nodes!r}: must be a whole number of 0 or more"
    if spare_nodes == 0:
        return None
    _, most = parse_nnodes(nnodes)
    if most < 2:
        return (f"{spares} {spare_nodes} with {size} {nnodes}: spares are for jobs of 2 nodes or more (a one-node "
                f"job restarts on its node); give {size} 2 or more, or leave {spares} out")
    if most + spare_nodes > MAX_NODES:
        return f"{spares} {spare_nodes}: at most {MAX_NODES} nodes in all are accepted"
    return None


def cross_problems(values: Mapping[str, Any], name: Callable[[str], str]) -> Iterable[str]:
    """The rules between two options, broken by ``values`` (every option's value): each a sentence naming the
    options as ``name`` calls them (the spec's ``'field'``, the command line's ``--flag``)."""
    why = spares_problem(values["nnodes"], values["spare_nodes"],
                         names=(name("spare_nodes"), name("nnodes")))
    if why is not None:
        yield why
    if values["flops_per_step"] and values["model_params"]:
        yield f"{name('model_params')} and {name('flops_per_step')} both say what a step costs; give one"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`trainwarden run`'s flag for every option, in the declaration's order. The values are checked once, by
    ``RunOptions`` (``Option.problem``), not by argparse: a flag and a spec field say the same thing in the same
    words."""
    costs = parser.add_mutually_exclusive_group()
    for option in LAUNCH_OPTIONS:
        add_argument(costs if option.name in ("flops_per_step", "model_params") else parser, option.name)


def add_argument(parser, name: str) -> None:
    """The flag (or the pair of flags, for a boolean) of the option ``name``, on ``parser`` or an argument group;
    other commands that take one of the options (`trainwarden env --tokens-per-step`) use this too."""
    option = OPTIONS[name]
    if option.kind is not bool:
        parser.add_argument(option.flag, dest=name, type=_reader(option), default=option.default,
                            choices=option.choices or None, metavar=option.metavar, help=option.help)
        return
    group = parser.add_mutually_exclusive_group() if option.on_flag else parser
    group.add_argument(option.off_flag, dest=name, action="store_false", help=option.help)
    if option.on_flag:
        group.add_argument(option.on_flag, dest=name, action="store_true", default=option.default,
                           help="the default; kept for scripts written for earlier releases")


def _reader(option: Option) -> Callable[[str], Any]:
    def read(text: str) -> Any:
        try:
            return option.kind(text)
        except ValueError:
            what = {int: "a whole number", float: "a number"}.get(option.kind, "a value")
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    read.__name__ = option.kind.__name__  # argparse names the type in its own messages
    return read


def launcher_flags(values: Mapping[str, Any]) -> list[str]:
    """The `trainwarden run` flags that give it ``values`` (a spec's): every option that differs from its default,
    in the declaration's order; ``nnodes`` always, so the launcher's log shows the job's size."""
    args: list[str] = []
    for option in LAUNCH_OPTIONS:
        value = values[option.name]
        if option.name != "nnodes" and (value == option.default or value is None):
            continue
        if option.kind is bool:
            args.append(option.off_flag if not value else option.on_flag)
        else:
            args += [option.flag, repr(float(value)) if option.kind is float else str(value)]
    return args

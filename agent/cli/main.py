"""The `trainwarden` command line: one entry point; each command's arguments and work live in the module
named for it (``run``, ``status`` for ``status`` and ``top``, ``incidents``, ``agent``). Errors in the input
print one line that says what to do and exit with ``EXIT_USAGE``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from trainwarden.agent import __version__
from trainwarden.agent.cli import agent, checkpoints, env, incidents, jobs, linkcheck, report, run, status
from trainwarden.agent.common import exit_codes
from trainwarden.agent.common.malloc_tuning import tune_malloc
from trainwarden.agent.common.process_exit import exit_now

__all__ = ["build_parser", "main", "whole_lines"]

COMMANDS = (run, status, incidents, checkpoints, report, agent, env, linkcheck)
"""Modules with an ``add_parser(subparsers)``, in the order ``--help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainwarden",
        description="Fault-tolerant training runtime with monitoring for PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"trainwarden {__version__}")
    parser.add_argument("--log-level", default=os.environ.get("TRAINWARDEN_LOG_LEVEL", "INFO"),
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log verbosity (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    jobs.add_parsers(sub)  # submit, jobs, stop, resume, cordon, drain, uncordon, nodes
    return parser


def whole_lines(stream) -> None:
    """Make each printed line one write. Under ``PYTHONUNBUFFERED`` (or ``-u``) print() writes a line's text
    and its newline separately, and torchrun's records, written to the same terminal or log by other
    processes, can land between the two; line buffering joins them."""
    try:
        stream.reconfigure(write_through=False, line_buffering=True)
    except (AttributeError, ValueError, OSError):  # not a TextIOWrapper (a test's capture): nothing to join
        pass


def main(argv: list[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):
        whole_lines(stream)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s trainwarden %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return exit_codes.EXIT_USAGE
    return args.func(args)


def entry() -> None:
    """The process's entry point (the ``trainwarden`` command, ``python -m trainwarden.agent.cli``): ``main``, then
    exit without the interpreter's finalization, which took about a second after a ``run`` had cleaned up
    (agent/common/process_exit.py). ``main`` itself returns, for callers in the same process."""
    tune_malloc()  # a long run's transient large buffers go back to the system (agent/common/malloc_tuning.py)
    try:
        code = main()
    except SystemExit as exit_:  # argparse's errors and --help
        if not isinstance(exit_.code, (int, type(None))):
            raise
        code = exit_.code
    exit_now(code)


if __name__ == "__main__":
    entry()

"""Argument types shared by the commands: a job name (the one rule), a positive number of seconds, a count."""

from __future__ import annotations

import argparse

from trainwarden.agent.proto.contract import validate_job_name

__all__ = ["job_name", "positive_float", "positive_int"]


def job_name(text: str) -> str:
    """A job name by the one rule (agent/proto/contract.py); argparse says what is wrong and exits 2."""
    try:
        return validate_job_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value

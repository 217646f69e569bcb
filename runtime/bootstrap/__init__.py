"""The directory the launcher puts first on the workers' PYTHONPATH: its ``sitecustomize`` arms
auto-instrumentation (trainwarden.runtime.auto). `path()` is where it is."""

from pathlib import Path


def path() -> str:
    """The directory to put first on a worker's PYTHONPATH."""
    return str(Path(__file__).resolve().parent)

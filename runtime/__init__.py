"""trainwarden.runtime: the in-worker library imported by training scripts.

    rt = trainwarden.runtime.init()          # after torch.distributed.init_process_group
    with rt.step(step, tokens=n): ...

Names are imported on first use so that `import trainwarden.runtime` stays light.
"""

__all__ = ["EXIT_ABORTED", "Session", "goodbye", "init"]


def __getattr__(name):
    if name in __all__:
        from . import session

        return getattr(session, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

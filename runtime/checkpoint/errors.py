"""What a failed DCP save or load says, in one line a person can read; whether it was the storage's doing."""

from __future__ import annotations

import re

from torch.distributed.checkpoint import CheckpointException

__all__ = ["SAVE_LOAD_ERRORS", "causes", "describe", "is_read_error"]

# DCP raises CheckpointException (a BaseException) when any rank failed inside one of its collectives.
SAVE_LOAD_ERRORS = (Exception, CheckpointException)


def describe(exc: BaseException) -> str:
    """One line per distinct cause; DCP's CheckpointException carries each failed rank's exception."""
    if isinstance(exc, CheckpointException):
        causes = {}
        for rank, failure in sorted(exc.failures.items()):
            cause = failure[0] if isinstance(failure, tuple) else failure
            causes.setdefault(_one_line(cause), []).append(rank)
        return "; ".join(f"{text} (ranks {ranks})" for text, ranks in causes.items())[:1500]
    return _one_line(exc)


# torch.load(weights_only=True) wraps what went wrong in a paragraph of advice about trusting the file; for a
# checkpoint whose bytes are damaged that advice (load it with weights_only=False) is wrong. Keep what went wrong.
_WEIGHTS_ONLY = re.compile(r"Weights only load failed\..*?WeightsUnpickler error: (?P<what>.*?)"
                           r"(?: Check the documentation of torch\.load.*)?$")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    weights_only = _WEIGHTS_ONLY.match(text)
    if weights_only:
        text = (f"a pickled entry could not be read ({weights_only['what']}): its bytes are not a checkpoint's "
                "tensors, numbers or strings")
    return f"{type(exc).__name__}: {text}"[:700]


def causes(exc: BaseException):
    """``exc`` and every exception it carries, each once: its cause and context, and each rank's failure in
    DCP's gathered ``CheckpointException``."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, CheckpointException):
            todo.extend(f[0] if isinstance(f, tuple) else f for f in e.failures.values())
        todo.extend((e.__cause__, e.__context__))


def is_read_error(exc: BaseException) -> bool:
    """Whether a failed load was the storage's doing (an OSError anywhere in the causes on any rank: I/O,
    stale handle, permission, timeout, a file gone) rather than wrong content."""
    return any(isinstance(e, OSError) for e in causes(exc))

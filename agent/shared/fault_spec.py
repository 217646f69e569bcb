"""The format of ``TRAINWARDEN_FAULTS``: the fault specification the launcher passes to workers.

Parsed in two places from this one module: by the runtime's ``FaultInjector`` (runtime/faults.py, which
documents the kinds) inside each worker, and by ``trainwarden run`` before it launches anything, so a typo is
one clear error at the start instead of every worker failing and being restarted.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ENV_VAR", "Fault", "FaultSpecError", "parse_faults"]

ENV_VAR = "TRAINWARDEN_FAULTS"

# kind -> (required keys, optional keys)
_KINDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "crash": (frozenset({"rank", "step"}), frozenset({"repeat"})),
    "stop": (frozenset({"rank", "step"}), frozenset({"repeat"})),
    "hang": (frozenset({"rank", "step"}), frozenset({"repeat"})),
    "exception": (frozenset({"rank", "step"}), frozenset({"repeat"})),
    "slow": (frozenset({"rank", "from", "factor"}), frozenset({"until"})),
    "slow_save": (frozenset({"rank", "step", "seconds"}), frozenset({"repeat"})),
    "nan": (frozenset({"rank", "step"}), frozenset({"repeat"})),
    "spike": (frozenset({"rank", "step", "factor"}), frozenset({"repeat"})),
    "snapflip": (frozenset({"rank", "step"}), frozenset({"repeat"})),
}


class FaultSpecError(ValueError):
    """``TRAINWARDEN_FAULTS`` is malformed. Not retryable: fix the specification."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One scheduled fault."""

    index: int
    """Position in the specification; names the fault's once-per-job marker."""
    kind: str
    """One of crash, stop, hang, exception, slow, slow_save, nan, spike, snapflip."""
    rank: int
    """Global rank the fault applies to."""
    step: int | None = None
    """Step at whose start a one-shot fault fires."""
    start: int | None = None
    """First slowed step (``slow``)."""
    until: int | None = None
    """First step no longer slowed (``slow``); None = never ends."""
    factor: float = 1.0
    """Step-time multiplier (``slow``), loss multiplier (``spike``)."""
    seconds: float = 0.0
    """Extra blocking time of the save (``slow_save``)."""
    repeat: bool = False
    """Fire again after a restart."""

    def describe(self) -> str:
        if self.kind == "slow":
            end = "" if self.until is None else f",until={self.until}"
            return f"slow:rank={self.rank},from={self.start}{end},factor={self.factor}"
        if self.kind == "slow_save":
            return f"slow_save:rank={self.rank},step={self.step},seconds={self.seconds}"
        if self.kind == "spike":
            return f"spike:rank={self.rank},step={self.step},factor={self.factor}"
        return f"{self.kind}:rank={self.rank},step={self.step}"


def _int(entry: str, key: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise FaultSpecError(f"fault {entry!r}: {key}={value!r} is not an integer") from None
    if number < 0:
        raise FaultSpecError(f"fault {entry!r}: {key} must be >= 0, got {number}")
    return number


def parse_faults(spec: str) -> list[Fault]:
    """Parse a specification string; raise ``FaultSpecError`` naming the first bad entry."""
    faults: list[Fault] = []
    for index, entry in enumerate(e.strip() for e in spec.split(";")):
        if not entry:
            continue
        kind, sep, rest = entry.partition(":")
        kind = kind.strip()
        if kind not in _KINDS:
            raise FaultSpecError(
                f"fault {entry!r}: unknown kind {kind!r}; known kinds: {', '.join(sorted(_KINDS))}"
            )
        required, optional = _KINDS[kind]
        values: dict[str, str] = {}
        for item in filter(None, (i.strip() for i in rest.split(","))) if sep else ():
            key, eq, value = item.partition("=")
            if not eq or not value:
                raise FaultSpecError(f"fault {entry!r}: expected key=value, got {item!r}")
            if key not in required | optional:
                allowed = ", ".join(sorted(required | optional))
                raise FaultSpecError(f"fault {entry!r}: unknown key {key!r} for {kind}; allowed: {allowed}")
            values[key] = value
        missing = required - values.keys()
        if missing:
            raise FaultSpecError(f"fault {entry!r}: missing {', '.join(sorted(missing))}")
        if kind == "slow":
            try:
                factor = float(values["factor"])
            except ValueError:
                raise FaultSpecError(f"fault {entry!r}: factor={values['factor']!r} is not a number") from None
            if not factor >= 1.0:
                raise FaultSpecError(f"fault {entry!r}: factor must be >= 1.0, got {factor}")
            start = _int(entry, "from", values["from"])
            until = _int(entry, "until", values["until"]) if "until" in values else None
            if until is not None and until <= start:
                raise FaultSpecError(f"fault {entry!r}: until ({until}) must be greater than from ({start})")
            faults.append(Fault(index=index, kind=kind, rank=_int(entry, "rank", values["rank"]),
                                start=start, until=until, factor=factor))
        else:
            seconds, factor = 0.0, 1.0
            if kind == "spike":
                try:
                    factor = float(values["factor"])
                except ValueError:
                    raise FaultSpecError(f"fault {entry!r}: factor={values['factor']!r} is not a number") from None
                if not factor > 1.0 or factor == float("inf"):
                    raise FaultSpecError(f"fault {entry!r}: factor must be a finite number above 1.0, got {factor}")
            if kind == "slow_save":
                try:
                    seconds = float(values["seconds"])
                except ValueError:
                    raise FaultSpecError(f"fault {entry!r}: seconds={values['seconds']!r} is not a number") from None
                if not seconds > 0:
                    raise FaultSpecError(f"fault {entry!r}: seconds must be > 0, got {seconds}")
            repeat = values.get("repeat", "0")
            if repeat not in ("0", "1"):
                raise FaultSpecError(f"fault {entry!r}: repeat must be 0 or 1, got {repeat!r}")
            faults.append(Fault(index=index, kind=kind, rank=_int(entry, "rank", values["rank"]),
                                step=_int(entry, "step", values["step"]), seconds=seconds, factor=factor,
                                repeat=repeat == "1"))
    return faults

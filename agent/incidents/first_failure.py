"""Which rank of a failed worker round failed first, and which ranks only followed it (collateral).

When one rank dies, every peer's next collective with it fails, and those peers exit too: torchrun then
reports five failed ranks for one fault. ``first_failure`` decides from structured evidence only, in this
order (DESIGN.md, "Name the first failure"):

1. **Last words.** A rank that said it left because a peer was gone (its goodbye starts with
   ``PEER_GONE``, or its torchrun error file holds a lost-peer error: ``PEER_FAILURE_MARKERS``) is
   collateral, whatever its exit code.
2. **Signal before exit code.** Of the rest, a rank killed by a signal (a negative exit code; SIGKILL by
   the OOM killer or an operator, SIGSEGV, SIGABRT) failed of itself: its peers cannot make it die of a
   signal, while they do make each other exit 1. A telemetry stream that broke without a goodbye before
   any other ended counts the same (the rank died hard; torchrun may not have reported it).
3. **Earliest exit.** Among the ranks of the winning tier, the one that exited first: the launcher's exit
   time (``exited_at``, from a pidfd: agent/launch/exit_clock.py), else when its telemetry stream ended.
   Ranks whose order is unknown (no times) are all named: we do not guess.

Every other failed rank is collateral. The caller has already left out the exits the agent or torchrun
caused (an abort, torchrun's SIGTERM to the survivors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from trainwarden.agent.shared.contract import PEER_FAILURE_MARKERS, PEER_FAILURE_TYPES, PEER_GONE

__all__ = ["FirstFailure", "first_failure", "says_peer_gone"]


@dataclass(frozen=True, kw_only=True)
class FirstFailure:
    """The verdict on one failed round."""

    first: tuple[int, ...]
    """Global rank(s) that failed first (several only when their order cannot be told)."""
    collateral: tuple[int, ...]
    """Ranks that failed because of it."""
    why: str
    """One line: the evidence that decided."""


def says_peer_gone(words: str | None) -> bool:
    """True when a rank's last words (goodbye or error-file message) say a peer was gone."""
    if not words:
        return False
    return words.startswith(PEER_GONE) or any(m in words for m in PEER_FAILURE_MARKERS + PEER_FAILURE_TYPES)


def first_failure(failures: Sequence[Mapping], ended: Sequence[Mapping] = ()) -> FirstFailure | None:
    """The verdict from the failed workers (``global_rank``, ``exitcode``, optional ``error`` and
    ``exited_at``) and the round's ended telemetry streams (``rank``, ``ended_at``, ``goodbye``, oldest
    first); None when nothing failed."""
    streams = {int(e["rank"]): e for e in ended}
    suspects: dict[int, _Suspect] = {}
    for f in failures:
        rank = int(f["global_rank"])
        stream = streams.get(rank, {})
        words = stream.get("goodbye") or f.get("error") or ""
        at = f.get("exited_at") if f.get("exited_at") is not None else stream.get("ended_at")
        tier = 2 if says_peer_gone(words) else 0 if int(f["exitcode"]) < 0 else 1
        suspects[rank] = _Suspect(rank, tier, at, _describe(f, words))
    if ended and ended[0].get("goodbye") is None and int(ended[0]["rank"]) not in suspects:
        rank = int(ended[0]["rank"])
        suspects[rank] = _Suspect(rank, 0, ended[0].get("ended_at"), "its stream broke first, without a goodbye")
    if not suspects:
        return None
    tier = min(s.tier for s in suspects.values())
    if tier == 2:  # every rank here followed a failure elsewhere (another node)
        said = next(s.how for s in suspects.values())
        return FirstFailure(first=(), collateral=tuple(sorted(suspects)), why=f"every failed rank here said a "
                            f"peer was gone ({said}): the failed rank is on another node")
    tied = [s for s in suspects.values() if s.tier == tier]
    leading = tied
    if all(s.at is not None for s in tied):
        earliest = min(float(s.at) for s in tied)
        leading = [s for s in tied if float(s.at) == earliest]
    first = tuple(sorted(s.rank for s in leading))
    collateral = tuple(sorted(r for r in suspects if r not in first))
    return FirstFailure(first=first, collateral=collateral, why=_why(leading, tier, len(tied)))


@dataclass(frozen=True)
class _Suspect:
    rank: int
    tier: int  # 0 died of a signal, 1 exited non-zero, 2 left because a peer was gone
    at: float | None
    how: str


def _describe(failure: Mapping, words: str) -> str:
    code = int(failure["exitcode"])
    how = str(failure.get("cause") or (f"signal {-code}" if code < 0 else f"exit code {code}"))
    return f"{how}, saying {words[:120]!r}" if words else how


def _why(leading: list[_Suspect], tier: int, tied: int) -> str:
    ranks = ", ".join(f"rank {s.rank} ({s.how})" for s in leading)
    rule = ("killed, not exited (its peers exit with a code: they cannot make a rank die of a signal)" if tier == 0
            else "exited with an error of its own, not a lost peer")
    if tied > len(leading):
        rule += f"; it exited first of the {tied} that did"
    elif tied > 1:
        rule += "; which of them failed first is unknown (no exit times)"
    return f"{ranks}: {rule}"

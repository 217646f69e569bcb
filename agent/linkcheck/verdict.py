"""Which links to probe, in what order, and what the samples say: a node's link, one pair, or nothing.

**Schedule.** Rounds of disjoint pairs, so no node takes part in two probes at once (a probe measures a link,
not a node shared by two probes). Up to ``full_upto`` nodes every pair is probed (a round-robin tournament:
N-1 rounds); beyond, ``rounds`` random perfect matchings (a seed makes them repeatable), which give each node
``rounds`` peers: enough to tell one bad node (slow against all its peers) from one bad pair.

**Verdict.** Every probe gives two directed links (A→B and B→A). The reference is the median of the faster
half of all directed links: a degraded node slows 2(N-1) of the N(N-1) links, fewer than half once N ≥ 3.
A directed link is *slow* below ``slow_ratio`` (0.2) of the reference: five times slower than the job's
healthy links. What one TCP stream achieves varies with the CPU's load (measured on a busy 2-core machine:
healthy links between 0.9 and 3.8 Gbit/s in one check, before taking the best of two windows), so a smaller
drop is not told from noise; the links that break a job's collectives are slower by far more. Then, for each node, its links out and in:
all of a node's links one way slow (and at least ``min_links`` of them) while its peers have fast links
elsewhere names the node and the direction (``out``, ``in`` or ``both``); a slow link whose two ends are not
named that way names the pair. Two nodes alone cannot be told apart from their link: the verdict says so.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from statistics import median
from typing import Iterable

from trainwarden.agent.linkcheck.probe import LinkSample

__all__ = ["Finding", "LinkReport", "judge", "schedule"]


def schedule(nodes: Iterable[str], *, full_upto: int = 16, rounds: int = 4, seed: int = 0) -> list[list[tuple[str, str]]]:
    """Rounds of disjoint (prober, peer) pairs over ``nodes`` (sorted first)."""
    names = sorted(set(nodes))
    if len(names) < 2:
        return []
    if len(names) <= full_upto:
        return _round_robin(names)
    rng = random.Random(seed)
    plan: list[list[tuple[str, str]]] = []
    used: set[frozenset] = set()
    sat_out = dict.fromkeys(names, 0)
    for _ in range(rounds):
        best = None
        for _attempt in range(20):  # a matching that repeats no pair probed already, if one comes quickly
            order = names[:]
            rng.shuffle(order)
            if len(order) % 2:  # the node that sat out least sits out this round
                out = min(order, key=lambda n: sat_out[n])
                order.remove(out)
                order.append(out)
            pairs = [(order[i], order[i + 1]) for i in range(0, len(order) - 1, 2)]
            repeats = sum(frozenset(p) in used for p in pairs)
            if best is None or repeats < best[0]:
                best = (repeats, pairs, order[-1] if len(order) % 2 else None)
            if repeats == 0:
                break
        _, pairs, out = best
        if out is not None:
            sat_out[out] += 1
        used.update(frozenset(p) for p in pairs)
        plan.append(pairs)
    return plan


def _round_robin(names: list[str]) -> list[list[tuple[str, str]]]:
    """The circle method: every pair exactly once, each round a matching (one node sits out when N is odd)."""
    ring = names + ([None] if len(names) % 2 else [])
    n, plan = len(ring), []
    for _ in range(n - 1):
        pairs = [(ring[i], ring[n - 1 - i]) for i in range(n // 2)]
        plan.append([(a, b) for a, b in pairs if a is not None and b is not None])
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return plan


@dataclass(frozen=True)
class Finding:
    """One thing the samples show: ``kind`` "node" (``nodes`` = (the node,), ``direction`` out/in/both) or
    "pair" (``nodes`` = the two ends, ``direction`` the slow way(s): "a->b", "b->a" or "both")."""

    kind: str
    nodes: tuple[str, ...]
    direction: str
    mbps: float
    """The slow links' median bandwidth."""

    def describe(self, reference: float) -> str:
        speed = f"{self.mbps:.0f} Mbit/s against {reference:.0f} Mbit/s on the job's healthy links"
        if self.kind == "node":
            way = {"out": "sending", "in": "receiving", "both": "both ways"}[self.direction]
            return f"node {self.nodes[0]}'s link is slow {way}: {speed}"
        a, b = self.nodes
        way = {"both": f"{a} <-> {b}", "a->b": f"{a} -> {b}", "b->a": f"{b} -> {a}"}[self.direction]
        return f"the link between {a} and {b} is slow ({way}): {speed}"


@dataclass
class LinkReport:
    samples: list[LinkSample]
    reference_mbps: float
    slow: dict[tuple[str, str], float]
    """Slow directed links: (from, to) → Mbit/s."""
    findings: list[Finding] = field(default_factory=list)
    failed: dict[tuple[str, str], str] = field(default_factory=dict)
    """Probes that could not be made: (prober, peer) → why."""
    note: str = ""
    missing: list[str] = field(default_factory=list)
    """Nodes that could not be probed, and why."""

    @property
    def healthy(self) -> bool:
        return not self.slow and not self.failed and not self.missing

    def summary(self) -> str:
        if self.findings:
            parts = [f.describe(self.reference_mbps) for f in self.findings]
        elif self.note:
            parts = [self.note]
        elif self.samples:
            parts = [f"no slow link among {len(self.samples)} probed pair(s) (reference "
                     f"{self.reference_mbps:.0f} Mbit/s)"]
        else:
            parts = []
        if self.failed:
            parts.append(f"{len(self.failed)} probe(s) could not be made: " + "; ".join(self.failed.values()))
        if self.missing:
            parts.append("not probed: " + "; ".join(self.missing))
        return "; ".join(parts) or "no link to probe"

    def to_json(self) -> dict:
        return {"samples": [s.to_json() for s in self.samples], "reference_mbps": self.reference_mbps,
                "slow": [{"from": a, "to": b, "mbps": v} for (a, b), v in sorted(self.slow.items())],
                "findings": [{"kind": f.kind, "nodes": list(f.nodes), "direction": f.direction, "mbps": f.mbps}
                             for f in self.findings],
                "failed": [{"prober": a, "peer": b, "why": w} for (a, b), w in sorted(self.failed.items())],
                "missing": list(self.missing),
                "summary": self.summary()}


def judge(samples: list[LinkSample], *, slow_ratio: float = 0.2, min_links: int = 2,
          failed: dict[tuple[str, str], str] | None = None) -> LinkReport:
    """What the samples show (module docstring)."""
    links: dict[tuple[str, str], float] = {}
    for s in samples:
        links[(s.src, s.dst)] = s.out_mbps
        links[(s.dst, s.src)] = s.in_mbps
    failed = dict(failed or {})
    if not links:
        return LinkReport(samples, 0.0, {}, failed=failed)
    speeds = sorted(links.values())
    reference = median(speeds[len(speeds) // 2:])
    slow = {k: v for k, v in links.items() if v < slow_ratio * reference}
    report = LinkReport(samples, reference, slow, failed=failed)
    nodes = sorted({n for pair in links for n in pair})
    if len(nodes) == 2:
        if slow:
            report.note = (f"the link between {nodes[0]} and {nodes[1]} is slower one way than the other "
                           f"({', '.join(f'{a} -> {b} {v:.0f} Mbit/s' for (a, b), v in sorted(slow.items()))}); "
                           f"with two nodes a node's link cannot be told from the pair's: a third node can")
        return report
    named: dict[str, str] = {}
    for node in nodes:
        outs = [k for k in links if k[0] == node]
        ins = [k for k in links if k[1] == node]
        out_slow = len(outs) >= min_links and all(k in slow for k in outs)
        in_slow = len(ins) >= min_links and all(k in slow for k in ins)
        if out_slow or in_slow:
            named[node] = "both" if out_slow and in_slow else "out" if out_slow else "in"
    # a node is named only if its peers are fine elsewhere: with every link slow, nothing stands out
    healthy_elsewhere = any(k not in slow for k in links if k[0] not in named and k[1] not in named)
    if named and not healthy_elsewhere:
        report.note = "every probed link is slow alike: no node or pair stands out (a fabric-wide problem?)"
        report.slow = slow
        return report
    for node, direction in sorted(named.items()):
        mine = [v for k, v in slow.items() if (node == k[0] and direction in ("out", "both"))
                or (node == k[1] and direction in ("in", "both"))]
        report.findings.append(Finding("node", (node,), direction, median(mine)))
    explained = {k for k in slow if (k[0] in named and named[k[0]] in ("out", "both"))
                 or (k[1] in named and named[k[1]] in ("in", "both"))}
    pairs: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for a, b in sorted(set(slow) - explained):
        pairs.setdefault(tuple(sorted((a, b))), []).append((a, b))
    for (a, b), ways in sorted(pairs.items()):
        direction = "both" if len(ways) == 2 else "a->b" if ways[0] == (a, b) else "b->a"
        report.findings.append(Finding("pair", (a, b), direction, median(slow[w] for w in ways)))
    return report

"""Link checks: which node's link, or which pair, makes a multi-node job's collectives slow.

The watchdog's communication-regression detector (agent/watchdog/comm_regression.py) sees that collectives
got slower on every rank; it cannot say where, because a collective is as slow as its slowest link for
everyone in it. Each node of a multi-node `trainwarden run` therefore runs a link probe server on its job
address (``probe.ProbeServer``, advertised in its membership record as ``linkprobe``), and ``check_links``
has the nodes measure their links to each other, one probe per node at a time (``verdict.schedule``), then
names a node and a direction, or a pair (``verdict.judge``). ``trainwarden linkcheck --job J`` runs it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Mapping

from trainwarden.agent.linkcheck.probe import LinkSample, ProbeError, ProbeServer, request_probe
from trainwarden.agent.linkcheck.verdict import Finding, LinkReport, judge, schedule

__all__ = ["Finding", "LinkReport", "LinkSample", "ProbeError", "ProbeServer", "RECORD_FIELD", "check_links",
           "probe_targets"]

log = logging.getLogger(__name__)

RECORD_FIELD = "linkprobe"
"""The membership record's field with the node's probe server: ``{"port": P, "token": T}``."""


def probe_targets(records: Mapping[str, Mapping]) -> tuple[dict[str, tuple[str, int, str]], list[str]]:
    """From the job's node records: (node → (address, port, token)) for those with a probe server, and why
    each other node cannot be probed."""
    targets, missing = {}, []
    for node, record in sorted(records.items()):
        probe, address = record.get(RECORD_FIELD) or {}, record.get("address") or ""
        try:
            port, token = int(probe["port"]), str(probe["token"])
        except (KeyError, TypeError, ValueError):
            missing.append(f"{node} runs no link probe (a single-node run, or a release before link checks)")
            continue
        if not address:
            missing.append(f"{node} has no job address in its record")
            continue
        targets[node] = (address, port, token)
    return targets, missing


def check_links(records: Mapping[str, Mapping], *, seconds: float = 0.5, full_upto: int = 16, rounds: int = 4,
                progress: Callable[[str], None] | None = None) -> LinkReport:
    """Probe the links between the job's nodes (their membership records) and judge them."""
    targets, missing = probe_targets(records)
    plan = schedule(targets, full_upto=full_upto, rounds=rounds)
    samples: list[LinkSample] = []
    failed: dict[tuple[str, str], str] = {}
    lock = threading.Lock()

    def one(prober: str, peer: str) -> None:
        addr, port, token = targets[prober]
        peer_addr, peer_port, peer_token = targets[peer]
        try:
            sample = request_probe(addr, port, token, peer=peer, peer_addr=peer_addr, peer_port=peer_port,
                                   peer_token=peer_token, seconds=seconds)
        except ProbeError as exc:
            with lock:
                failed[(prober, peer)] = str(exc)
            return
        with lock:
            samples.append(sample)

    for index, pairs in enumerate(plan, start=1):
        start = time.monotonic()
        threads = [threading.Thread(target=one, args=pair, daemon=True) for pair in pairs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if progress is not None:
            progress(f"round {index}/{len(plan)}: {len(pairs)} pair(s) in {time.monotonic() - start:.1f} s")
    report = judge(samples, failed=failed)
    report.missing = missing
    return report

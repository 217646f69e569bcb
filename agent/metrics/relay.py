"""The node daemon's endpoint carries the series of every job it runs: each launcher's endpoint, relayed at scrape time.

Design
------
A daemon-run job's launcher (``trainwarden run --managed``) is a full supervisor with its own in-process agent, so
that the daemon's death costs the job nothing; its Prometheus endpoint is on loopback, on a port picked at start
(recorded in the job's state directory, ``agent.metrics.url``). Prometheus scrapes the node's target, the daemon's
``:9478``. ``LauncherRelay`` is a collector on the daemon's registry: on every scrape it fetches each launcher's
``/metrics`` (all at once, each bounded by ``timeout_s``) and yields the series that belong to that launcher's job
(a ``job`` label equal to the job's name). The launcher's node-wide series (GPU and host health, the agent's own
info) are left out: the daemon exports its own for the same node.

``trainwarden_job_metrics_up{job,node}`` is 1 when the job's launcher answered this scrape, 0 when it did not (not
yet serving, wedged, gone): a job's series missing from a scrape say which. A launcher that does not answer costs
its own series for that scrape, never the node's (a scrape waits ``timeout_s`` at most, below Prometheus's
``scrape_timeout``).

Why a relay and not Prometheus service discovery (``http_sd_configs`` listing each launcher's port): every existing
way of scraping the node (a static or file list of ``host:9478``, the Kubernetes pod annotations and
ServiceMonitor) keeps working and sees the node's jobs without a change; launchers' endpoints stay on loopback (no
ephemeral ports to open in a firewall or a NetworkPolicy); and an SD URL per node has no place in a Kubernetes
setup whose nodes come and go. The cost is that the node's ``up`` no longer says that every job answered: the
gauge above does.

The URL comes from a file the job's user writes, and the daemon is root: the relay fetches only
``http://127.0.0.1:<port>/metrics`` (or ``[::1]``), with a raw GET bounded in time and size, and reads the record
without following links or blocking on special files (agent/metrics/launcher_fetch.py). A job whose record is
anything else is skipped (``up`` 0) with one warning naming what is wrong.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from trainwarden.agent.metrics.launcher_fetch import DEFAULT_MAX_BODY_BYTES, TargetRefused, fetch_metrics, \
    launcher_target

logger = logging.getLogger(__name__)

__all__ = ["LauncherRelay"]

Fetch = Callable[[str, float], str]
"""``(url, deadline_s) -> body``; raises when the launcher does not answer in time."""


class LauncherRelay:
    """Yields, at scrape time, the job series of every launcher ``targets()`` names (module docstring)."""

    def __init__(self, targets: Callable[[], Mapping[str, "str | TargetRefused"]], *, node: str,
                 fetch: Fetch | None = None, timeout_s: float = 3.0, io_timeout_s: float = 1.0,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        """``targets()``: job name -> that job's launcher metrics URL ("" while it serves none yet), or the
        ``TargetRefused`` its record earned, for the jobs running on this node now. ``timeout_s``: a fetch's whole
        deadline; ``io_timeout_s``: its connect and each read; ``max_body_bytes``: the most of a body read."""
        if not 0 < io_timeout_s <= timeout_s:
            raise ValueError(f"io_timeout_s must be in (0, timeout_s={timeout_s}], got {io_timeout_s}")
        if max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {max_body_bytes}")
        if fetch is None:
            def fetch(url: str, deadline_s: float) -> str:
                return fetch_metrics(url, io_timeout_s, deadline_s=deadline_s, max_bytes=max_body_bytes)
        self._targets, self._node, self._fetch, self._timeout = targets, node, fetch, timeout_s
        self._failing: set[str] = set()  # jobs whose last fetch failed (logged once per outage)
        self._refused: dict[str, str] = {}  # job -> why its target is refused (logged once per reason)

    def collect(self) -> Iterator[Metric]:
        targets = dict(self._targets())
        up = GaugeMetricFamily("trainwarden_job_metrics_up", "1 when the launcher of the job on this node answered "
                               "the daemon's last scrape of it (its series are on the daemon's endpoint)",
                               labels=["job", "node"])
        if not targets:
            yield up
            return
        with ThreadPoolExecutor(max_workers=min(8, len(targets)), thread_name_prefix="trainwarden-relay") as pool:
            bodies = dict(zip(targets, pool.map(self._get, targets.items())))
        for job, body in sorted(bodies.items()):
            up.add_metric([job, self._node], 0.0 if body is None else 1.0)
            if body is not None:
                yield from _job_families(body, job)
        yield up

    def _get(self, target: tuple[str, str]) -> str | None:
        job, url = target
        if not url:
            return None
        try:
            if isinstance(url, TargetRefused):
                raise url
            launcher_target(url)
        except TargetRefused as exc:
            if self._refused.get(job) != str(exc):
                logger.warning("job %s: its recorded metrics target is refused and not fetched: %s; its series are "
                               "missing from the node's endpoint until its launcher records an allowed URL", job, exc)
            self._refused[job] = str(exc)
            return None
        self._refused.pop(job, None)
        try:
            body = self._fetch(url, self._timeout)
        except Exception as exc:  # refused, timed out, reset: this scrape goes on without the job's series
            if job not in self._failing:
                logger.warning("job %s: its launcher's metrics at %s do not answer (%s); its series are missing "
                               "from the node's endpoint until they do", job, url, exc)
            self._failing.add(job)
            return None
        if job in self._failing:
            logger.info("job %s: its launcher's metrics at %s answer again", job, url)
        self._failing.discard(job)
        return body


def _job_families(body: str, job: str) -> Iterator[Metric]:
    """The families of a launcher's exposition, each with only the samples labelled with its job."""
    try:
        families = list(text_string_to_metric_families(body))
    except ValueError as exc:
        logger.warning("job %s: its launcher's metrics do not parse (%s); left out of this scrape", job, exc)
        return
    for family in families:
        samples = [s for s in family.samples if s.labels.get("job") == job]
        if samples:
            kept = Metric(family.name, family.documentation, family.type, family.unit)
            kept.samples = samples
            yield kept

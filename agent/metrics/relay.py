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
"""

from __future__ import annotations

import logging
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

__all__ = ["LauncherRelay", "http_get"]

Fetch = Callable[[str, float], str]


def http_get(url: str, timeout_s: float) -> str:
    """The body of ``url`` (Prometheus's text format: no Accept header asks for OpenMetrics)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode("utf-8")


class LauncherRelay:
    """Yields, at scrape time, the job series of every launcher ``targets()`` names (module docstring)."""

    def __init__(self, targets: Callable[[], Mapping[str, str]], *, node: str, fetch: Fetch = http_get,
                 timeout_s: float = 3.0) -> None:
        """``targets()``: job name -> that job's launcher metrics URL ("" while it serves none yet), for the jobs
        running on this node now."""
        self._targets, self._node, self._fetch, self._timeout = targets, node, fetch, timeout_s
        self._failing: set[str] = set()  # jobs whose last fetch failed (logged once per outage)

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

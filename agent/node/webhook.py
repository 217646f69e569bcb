"""Alertmanager resumes failed jobs: the daemon's webhook (``--webhook-listen``, ``--webhook-token-file``).

Alertmanager posts its notifications (webhook payload version 4) to ``POST /v1/alertmanager`` with
``Authorization: Bearer <token>`` (``http_config.authorization.credentials_file`` in its config; the example is
deploy/alertmanager.yml). Each request is checked in this order, and nothing is read from etcd before it passes:

* the path (404) and the method (405);
* the token, compared in constant time with the one in ``--webhook-token-file`` (re-read when the file changes,
  so a rotation needs no restart): 401 when it is missing or wrong;
* the size: a body over ``max_body`` bytes, or one without ``Content-Length``, is not read (413, 411);
* the payload: JSON, version "4", and every field the decision uses of the right type (400, naming the field).

Each alert of an accepted request then gets one ``Decision`` (``AlertResumer.decide``):

* ``ignored``: a resolved alert, or one whose rule does not ask for a resume (the label
  ``trainwarden_action="resume"``, which the rule ``TrainwardenJobFailed`` carries);
* ``rejected``: no ``job`` or no ``generation`` label (only the generation an alert names is resumed), a job etcd
  does not have, one started by hand, one whose spec says
  ``auto_resume = false``, or one that is not failed (a stopped job stays stopped: an operator stopped it);
* ``duplicate``: that generation was resumed already (Alertmanager repeats notifications, and a fleet may post to
  several daemons: the resume is one etcd transaction per (job, generation), ``JobControl.resume_once``);
* ``throttled``: the job was resumed ``resumes_per_hour`` times in the last hour already (a job that fails
  again at once needs a human, not a loop);
* ``accepted``: the next generation is written in ``pending``; the daemons of its nodes start it, and it
  restores its latest checkpoint.

Every decision but ``ignored`` is an incident of the job (``auto_resume``, when the job exists) and every one is
counted in ``trainwarden_webhook_decisions_total{decision}``; refused requests are counted in
``trainwarden_webhook_requests_total{code}`` and logged, at most once a minute per code (an unauthenticated
sender writes no records). With etcd unreachable the answer is 503, so Alertmanager retries.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import ssl
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from trainwarden.agent.common.bounded_http import BoundedHTTPServer
from trainwarden.agent.common.job_lifecycle import JobPhase
from trainwarden.agent.shared.contract import validate_job_name
from trainwarden.agent.etcd.jobs import JobConflict, JobControl
from trainwarden.agent.incidents.record import Incident, IncidentKind, IncidentState, new_incident_id

logger = logging.getLogger(__name__)

__all__ = ["PATH", "AlertResumer", "AlertmanagerWebhook", "Decision", "PayloadError", "WebhookConfig",
           "parse_payload"]

PATH = "/v1/alertmanager"
ACTION_LABEL = "trainwarden_action"
DECISIONS = ("accepted", "duplicate", "throttled", "rejected", "ignored")
_MAX_ALERTS = 1000


@dataclass(frozen=True, kw_only=True)
class WebhookConfig:
    """Where the webhook listens and what it accepts."""

    listen: str
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6); port 0 picks a free one."""
    token_file: Path
    """The bearer token Alertmanager sends (its ``credentials_file``), one line."""
    tls_cert: Path | None = None
    tls_key: Path | None = None
    max_body: int = 256 * 1024
    """Bytes; Alertmanager's payload for a group of a few alerts is a few KiB."""
    resumes_per_hour: int = 3
    """At most this many automatic resumes of one job in any hour."""

    def __post_init__(self) -> None:
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"--webhook-listen {self.listen!r}: expected HOST:PORT, e.g. 0.0.0.0:9480")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--webhook-tls-cert and --webhook-tls-key go together: give both, or neither for plain "
                             "HTTP")
        if self.max_body < 1024:
            raise ValueError(f"--webhook-max-body {self.max_body}: must be at least 1024 bytes")
        if self.resumes_per_hour < 0:
            raise ValueError(f"--resumes-per-hour {self.resumes_per_hour}: must be 0 or more (0: never resume)")
        read_token(self.token_file)  # ValueError saying what is wrong with it

    @property
    def address(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)


def read_token(path: Path) -> bytes:
    try:
        token = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"--webhook-token-file {path}: cannot read it ({exc.strerror or exc})") from None
    if not token or b"\n" in token:
        raise ValueError(f"--webhook-token-file {path}: must hold one line, the bearer token Alertmanager sends "
                         "(e.g. `openssl rand -hex 32 > FILE`)")
    if len(token) < 16:
        raise ValueError(f"--webhook-token-file {path}: the token is {len(token)} characters; use at least 16 "
                         "(e.g. `openssl rand -hex 32 > FILE`)")
    return token


class PayloadError(ValueError):
    """A request body that is not an Alertmanager version 4 payload (the message names the field)."""


def _expect(value: Any, kind: type, where: str) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool):
        names = {dict: "an object", list: "a list", str: "a string", int: "a number"}
        raise PayloadError(f"{where} must be {names[kind]}, got {type(value).__name__}")
    return value


def _labels(value: Any, where: str) -> dict[str, str]:
    for key, item in _expect(value, dict, where).items():
        _expect(item, str, f"{where}.{key}")
    return value


def parse_payload(body: bytes) -> dict[str, Any]:
    """The payload, checked field by field; ``PayloadError`` naming the first field that is wrong."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise PayloadError(f"not JSON: {exc}") from None
    _expect(payload, dict, "the payload")
    if payload.get("version") != "4":
        raise PayloadError(f"version must be \"4\" (Alertmanager's webhook payload), got {payload.get('version')!r}")
    for key in ("receiver", "status", "groupKey"):
        _expect(payload.get(key), str, key)
    if payload["status"] not in ("firing", "resolved"):
        raise PayloadError(f"status must be firing or resolved, got {payload['status']!r}")
    for key in ("groupLabels", "commonLabels", "commonAnnotations"):
        if key in payload:
            _labels(payload[key], key)
    alerts = _expect(payload.get("alerts"), list, "alerts")
    if not alerts or len(alerts) > _MAX_ALERTS:
        raise PayloadError(f"alerts must hold 1 to {_MAX_ALERTS} alerts, got {len(alerts)}")
    for i, alert in enumerate(alerts):
        where = f"alerts[{i}]"
        _expect(alert, dict, where)
        if alert.get("status") not in ("firing", "resolved"):
            raise PayloadError(f"{where}.status must be firing or resolved, got {alert.get('status')!r}")
        _labels(alert.get("labels"), f"{where}.labels")
        _labels(alert.get("annotations", {}), f"{where}.annotations")
        _expect(alert.get("startsAt"), str, f"{where}.startsAt")
        if "fingerprint" in alert:
            _expect(alert["fingerprint"], str, f"{where}.fingerprint")
    return payload


@dataclass(frozen=True)
class Decision:
    decision: str
    """One of ``DECISIONS``."""
    reason: str
    job: str | None = None
    generation: int | None = None
    resumed_as: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


class AlertResumer:
    """What to do with one alert (module docstring); the decision is recorded and counted."""

    def __init__(self, control: JobControl, *, node: str, resumes_per_hour: int = 3,
                 record: Callable[[Incident], Incident] | None = None, clock: Callable[[], float] = time.time) -> None:
        self._control, self.node, self._limit = control, node, resumes_per_hour
        self._record, self._clock = record, clock
        self._lock = threading.Lock()  # one decision at a time: the rate limit counts what the last one wrote
        self.counts = dict.fromkeys(DECISIONS, 0)

    def decide(self, alert: dict[str, Any], *, receiver: str = "", received_at: float | None = None) -> Decision:
        """``received_at``: when the request arrived (kept with an accepted resume, for the timings)."""
        with self._lock:
            decision = self._decide(alert, self._clock() if received_at is None else received_at)
            self.counts[decision.decision] += 1
        level = logging.INFO if decision.decision in ("accepted", "ignored") else logging.WARNING
        logger.log(level, "alert %s for job %s: %s (%s)", alert.get("labels", {}).get("alertname", "?"),
                   decision.job or "?", decision.decision, decision.reason)
        if decision.decision != "ignored":
            self._note(decision, alert, receiver)
        return decision

    def _decide(self, alert: dict[str, Any], received_at: float) -> Decision:
        labels = alert["labels"]
        if alert["status"] != "firing":
            return Decision("ignored", "the alert is resolved", labels.get("job"))
        if labels.get(ACTION_LABEL) != "resume":
            return Decision("ignored", f"the alert does not ask for a resume ({ACTION_LABEL}=\"resume\")",
                            labels.get("job"))
        job = labels.get("job")
        if not job:
            return Decision("rejected", "the alert has no job label")
        try:
            validate_job_name(job)
        except ValueError as exc:
            return Decision("rejected", f"job label {job!r} is not a job name: {exc}")
        if "generation" not in labels:  # a replayed alert would resume whatever generation failed since (issue 44)
            return Decision("rejected", "the alert has no generation label, so it cannot say which failure it is "
                                        "about; the rule TrainwardenJobFailed carries it (trainwarden_job_phase's "
                                        "generation): keep it in the rule and in Alertmanager's group_by", job)
        if not labels["generation"].isdigit():
            return Decision("rejected", f"generation label {labels['generation']!r} is not a number", job)
        asked = int(labels["generation"])
        view = self._control.job(job)
        if view is None:
            return Decision("rejected", "etcd has no such job", job)
        if not view.managed:
            return Decision("rejected", "the job was started by hand with `trainwarden run`, not submitted", job)
        if not view.job_spec().auto_resume:
            return Decision("rejected", "its spec says auto_resume = false", job, view.generation)
        generation = asked
        done = {int(r.get("generation", -1)): r for r in self._control.auto_resumes(job)}
        if generation in done:
            return Decision("duplicate", f"generation {generation} was resumed already, as generation "
                                         f"{done[generation].get('resumed_as')}", job, generation)
        if generation != view.generation:
            return Decision("rejected", f"the alert is about generation {generation}; the job is in generation "
                                        f"{view.generation} ({view.phase})", job, generation)
        if view.phase != JobPhase.FAILED.value:
            return Decision("rejected", f"the job is {view.phase}, not failed", job, generation)
        now = self._clock()
        recent = [r for r in done.values() if now - float(r.get("at", 0)) < 3600]
        if len(recent) >= self._limit:
            return Decision("throttled", f"resumed {len(recent)} times in the last hour (the limit is {self._limit});"
                                         f" `trainwarden resume {job}` once it is fixed", job, generation)
        try:
            resumed_as = self._control.resume_once(
                job, generation, by=f"alert {labels.get('alertname', '?')} via trainwarden agent on {self.node}",
                record={"alert": labels.get("alertname", ""), "fingerprint": alert.get("fingerprint", ""),
                        "startsAt": alert.get("startsAt", ""), "node": self.node, "received_at": received_at})
        except JobConflict as exc:
            return Decision("duplicate", str(exc), job, generation)
        return Decision("accepted", f"resumed as generation {resumed_as}", job, generation, resumed_as)

    def _note(self, decision: Decision, alert: dict[str, Any], receiver: str) -> None:
        if self._record is None or decision.job is None or decision.reason == "etcd has no such job":
            return
        try:
            self._record(Incident(
                id=new_incident_id(), kind=IncidentKind.AUTO_RESUME, job=decision.job, node=self.node,
                evidence={"decision": decision.decision, "reason": decision.reason, "receiver": receiver,
                          "alert": dict(alert.get("labels", {})), "startsAt": alert.get("startsAt", ""),
                          "fingerprint": alert.get("fingerprint", ""), "generation": decision.generation},
                detected_at=time.time(), state=IncidentState.RESOLVED,
                action=(f"resumed as generation {decision.resumed_as}" if decision.resumed_as else "none"),
                outcome=f"{decision.decision}: {decision.reason}"))
        except Exception:  # the decision stands; its record is best effort
            logger.exception("cannot record the webhook decision for job %s", decision.job)


class AlertmanagerWebhook:
    """The HTTP(S) server in front of ``AlertResumer`` (module docstring); a prometheus_client collector."""

    def __init__(self, config: WebhookConfig, resumer: AlertResumer) -> None:
        self.config, self.resumer = config, resumer
        self._token, self._token_stat = read_token(config.token_file), _stat(config.token_file)
        self._requests: dict[int, int] = {}
        self._last_log: dict[int, float] = {}
        self._lock = threading.Lock()
        self._server: BoundedHTTPServer | None = None
        self._tls: ssl.SSLContext | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "start() first"
        host, port = self._server.server_address[:2]
        host = f"[{host}]" if ":" in host else host
        return f"{'https' if self.config.tls_cert else 'http'}://{host}:{port}{PATH}"

    def start(self) -> "AlertmanagerWebhook":
        """Bind and serve on a thread; ``OSError`` when the address cannot be bound."""
        host, port = self.config.address
        if self.config.tls_cert is not None:
            self._tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self._tls.minimum_version = ssl.TLSVersion.TLSv1_2
            self._tls.load_cert_chain(self.config.tls_cert, self.config.tls_key)
        # bounded threads, idle connections closed after 5 s without one of their own (agent/common/bounded_http.py)
        self._server = _Server((host, port), _handler(self), max_threads=8, idle_timeout_s=5.0,
                               request_timeout_s=10.0, name="trainwarden-webhook")
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.1,), name="trainwarden-webhook",
                                        daemon=True)
        self._thread.start()
        logger.info("Alertmanager webhook serving on %s (resumes at most %d per job per hour)", self.url,
                    self.config.resumes_per_hour)
        return self

    def liveness(self) -> str | None:
        """None while the server thread serves; what is wrong otherwise (the daemon's keep-alives)."""
        if self._thread is not None and not self._thread.is_alive() and self._server is not None:
            return "the Alertmanager webhook's server thread has ended"
        return None

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def token_matches(self, header: str | None) -> bool:
        if not header or not header.startswith("Bearer "):
            return False
        stat = _stat(self.config.token_file)
        if stat != self._token_stat:  # rotated: read the new one (a file that cannot be read keeps the old)
            try:
                self._token, self._token_stat = read_token(self.config.token_file), stat
            except ValueError as exc:
                logger.error("%s; still using the previous token", exc)
        return hmac.compare_digest(header[len("Bearer "):].strip().encode(), self._token)

    def count(self, code: int, why: str) -> None:
        with self._lock:
            self._requests[code] = self._requests.get(code, 0) + 1
            now = time.monotonic()
            quiet = now - self._last_log.get(code, -1e9) < 60
            if not quiet:
                self._last_log[code] = now
        if code >= 400 and not quiet:
            logger.warning("webhook request refused (%d): %s (logged at most once a minute per status)", code, why)

    def collect(self) -> Iterator[Metric]:
        decisions = CounterMetricFamily("trainwarden_webhook_decisions", "Alerts the Alertmanager webhook decided "
                                        "on, by decision (accepted: the job resumed)", labels=["decision"])
        for decision, n in self.resumer.counts.items():
            decisions.add_metric([decision], float(n))
        yield decisions
        requests = CounterMetricFamily("trainwarden_webhook_requests", "Requests to the Alertmanager webhook, by "
                                       "HTTP status (401: bad token, 400: malformed, 413: too large)",
                                       labels=["code"])
        with self._lock:
            for code, n in sorted(self._requests.items()):
                requests.add_metric([str(code)], float(n))
        yield requests


def _stat(path: Path) -> tuple[float, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime, st.st_size


class _Server(BoundedHTTPServer):

    def handle_error(self, request, client_address) -> None:
        """A client that hangs up or fails the TLS handshake: one debug line, not a traceback on stderr."""
        import sys

        logger.debug("webhook: request from %s failed: %s", client_address[0], sys.exc_info()[1])


def _handler(webhook: AlertmanagerWebhook) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "trainwarden-webhook"
        timeout = 10  # a client that stalls mid-request does not hold a thread for long

        def setup(self) -> None:
            # the TLS handshake runs here, on the request's own thread: a client that stalls in it holds
            # neither the accept loop nor any other request
            if webhook._tls is not None:
                self.request.settimeout(self.timeout)
                self.request = webhook._tls.wrap_socket(self.request, server_side=True)
            super().setup()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
            logger.debug("webhook %s: " + format, self.client_address[0], *args)

        def _reply(self, code: int, body: dict[str, Any], *, why: str = "") -> None:
            webhook.count(code, why or body.get("error", ""))
            data = (json.dumps(body) + "\n").encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if code == 401:
                self.send_header("WWW-Authenticate", 'Bearer realm="trainwarden"')
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._reply(405 if self.path == PATH else 404, {"error": f"POST an Alertmanager payload to {PATH}"})

        do_PUT = do_DELETE = do_PATCH = do_GET

        def do_POST(self) -> None:
            received_at = time.time()
            if self.path != PATH:
                return self._reply(404, {"error": f"POST to {PATH}"})
            if not webhook.token_matches(self.headers.get("Authorization")):
                self.close_connection = True
                return self._reply(401, {"error": "missing or wrong bearer token"})
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                self.close_connection = True
                return self._reply(411, {"error": "Content-Length is required"})
            if int(length) > webhook.config.max_body:
                self.close_connection = True  # the body is not read
                return self._reply(413, {"error": f"the body is {length} bytes; the limit is "
                                                  f"{webhook.config.max_body}"})
            try:
                payload = parse_payload(self.rfile.read(int(length)))
            except PayloadError as exc:
                return self._reply(400, {"error": f"not an Alertmanager webhook payload: {exc}"})
            decisions = []
            try:
                for alert in payload["alerts"]:
                    decisions.append(webhook.resumer.decide(alert, receiver=payload["receiver"],
                                                           received_at=received_at).to_json())
            except Exception as exc:  # etcd unreachable: Alertmanager retries a 5xx
                logger.warning("webhook: cannot decide (%s: %s); answering 503 so Alertmanager retries",
                               type(exc).__name__, exc)
                return self._reply(503, {"error": f"cannot reach etcd ({type(exc).__name__}); retry",
                                         "decisions": decisions})
            self._reply(200, {"decisions": decisions})

    return Handler

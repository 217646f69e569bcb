"""The alert path on loopback, for the auto-resume test and benchmark: a real etcd, a `trainwarden agent` daemon
serving Alertmanager's webhook, a real Prometheus scraping it with trainwarden's rules, and a real Alertmanager
(Debian ``prometheus-alertmanager``) configured from ``deploy/alertmanager.yml``.

Everything is started through a ``procs.ProcessGroup`` (own sessions; killed by the caller's fixture) except the
daemon's launchers, which run in sessions of their own by design and are stopped by ``close()`` from their
records, by pid and start time.
"""

from __future__ import annotations

import calendar
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from procs import ProcessGroup, stop_recorded_launchers, wait_for
from trainwarden.agent.etcd.client import open_client
from trainwarden.agent.etcd.embedded import free_port
from trainwarden.agent.etcd.jobs import JobControl
from trainwarden.agent.etcd.keys import job_key

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"\[rank 0\] [\w.]+: step (\d+) loss")
RESUMED = "[rank 0] trainwarden.runtime.examples.gpt: resumed from checkpoint step"
TOKEN = "0123456789abcdef0123456789abcdef"


def alertmanager_binary() -> str | None:
    import shutil

    return shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")


@dataclass
class Transition:
    at: float
    generation: int
    phase: str


@dataclass
class PhaseWatch:
    """Polls ``jobs/<job>/state`` every 50 ms and keeps each (generation, phase) with the time it was first seen."""

    client: object
    key: str
    seen: list[Transition] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> "PhaseWatch":
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        last = None
        while not self._stop.wait(0.05):
            try:
                value, _ = self.client.get(self.key)
            except Exception:
                continue
            if value is None:
                continue
            state = json.loads(value)
            now = (int(state.get("generation", 0)), state.get("phase"))
            if now != last:
                self.seen.append(Transition(time.time(), *now))
                last = now

    def first(self, generation: int, phase: str) -> Transition | None:
        return next((t for t in self.seen if (t.generation, t.phase) == (generation, phase)), None)

    def stop(self) -> None:
        self._stop.set()


class AlertingBed:
    """etcd + daemon (webhook) + Prometheus + Alertmanager, all on 127.0.0.1."""

    def __init__(self, procs: ProcessGroup, tmp: Path, etcd: str, *, node: str = "n0",
                 resumes_per_hour: int = 3) -> None:
        self.procs, self.tmp, self.etcd, self.node = procs, tmp, etcd, node
        self.home = tmp / node
        self.home.mkdir(parents=True, exist_ok=True)
        self.token_file = tmp / "webhook-token"
        self.token_file.write_text(TOKEN + "\n")
        self.metrics_port, self.webhook_port = free_port(), free_port()
        self.prom_port, self.am_port = free_port(), free_port()
        self.resumes_per_hour = resumes_per_hour
        self.daemon: subprocess.Popen | None = None

    @property
    def webhook_url(self) -> str:
        return f"http://127.0.0.1:{self.webhook_port}/v1/alertmanager"

    def start(self) -> "AlertingBed":
        self.start_daemon()
        self.start_prometheus()
        self.start_alertmanager()
        return self

    def start_daemon(self) -> None:
        home = self.home
        self.daemon = self.procs.spawn(
            [sys.executable, "-m", "trainwarden.agent.cli", "agent", "--etcd", self.etcd, "--node", self.node,
             "--state-home", str(home), "--socket", str(home / "agent.sock"), "--metrics-host", "127.0.0.1",
             "--metrics-port", str(self.metrics_port), "--local-addr", "127.0.0.1",
             "--webhook-listen", f"127.0.0.1:{self.webhook_port}", "--webhook-token-file", str(self.token_file),
             "--resumes-per-hour", str(self.resumes_per_hour),
             "--job-user", str(os.getuid()), "--allow-root-jobs"],  # the jobs run as the test does
            log=home / "daemon.log", env=dict(os.environ))
        wait_for(lambda: f"agent {self.node} serving:" in self.daemon_log() or self.daemon.poll() is not None, 60,
                 what="the daemon to serve")
        assert self.daemon.poll() is None, self.daemon_log()[-3000:]

    def start_prometheus(self) -> None:
        config = self.tmp / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"rule_files: ['{ROOT / 'dashboards' / 'prometheus' / 'alerts.yml'}']\n"
            "alerting:\n  alertmanagers:\n"
            f"    - static_configs:\n        - targets: ['127.0.0.1:{self.am_port}']\n"
            "scrape_configs:\n  - job_name: trainwarden-agent\n    honor_labels: true\n"
            f"    static_configs:\n      - targets: ['127.0.0.1:{self.metrics_port}']\n")
        self.procs.spawn(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={self.tmp / 'tsdb'}",
                          f"--web.listen-address=127.0.0.1:{self.prom_port}"], log=self.tmp / "prometheus.log")

    def start_alertmanager(self) -> None:
        """deploy/alertmanager.yml with the webhook's url and token file replaced (nothing else)."""
        config = yaml.safe_load((ROOT / "deploy" / "alertmanager.yml").read_text())
        found = 0
        for receiver in config["receivers"]:
            for hook in receiver.get("webhook_configs", []):
                hook["url"] = self.webhook_url
                hook["http_config"]["authorization"]["credentials_file"] = str(self.token_file)
                found += 1
        assert found == 1, "deploy/alertmanager.yml should have one webhook receiver"
        path = self.tmp / "alertmanager.yml"
        path.write_text(yaml.safe_dump(config))
        self.procs.spawn([alertmanager_binary(), f"--config.file={path}", f"--storage.path={self.tmp / 'am'}",
                          f"--web.listen-address=127.0.0.1:{self.am_port}", "--cluster.listen-address="],
                         log=self.tmp / "alertmanager.log")
        wait_for(lambda: _get(f"http://127.0.0.1:{self.am_port}/-/ready") is not None, 60,
                 what="Alertmanager to be ready")

    # ---- reading -------------------------------------------------------------------------------------

    def daemon_log(self) -> str:
        path = self.home / "daemon.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def job_log(self, job: str) -> str:
        path = self.home / "daemon" / "logs" / f"{job}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def incidents(self, job: str, kind: str) -> list[dict]:
        found = []
        for path in sorted((self.home / "daemon" / "records" / job / "incidents").glob("*.json")):  # the daemon's
            data = json.loads(path.read_text())
            if data["kind"] == kind:
                found.append(data)
        return found

    def metric(self, name: str, **labels: str) -> float | None:
        text = _get(f"http://127.0.0.1:{self.metrics_port}/metrics") or ""
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # prometheus_client sorts them
        for line in text.splitlines():
            if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(f"{name} ")):
                return float(line.rsplit(" ", 1)[1])
        return None

    def post(self, body: bytes, *, token: str | None = TOKEN, headers: dict | None = None) -> tuple[int, dict]:
        request = urllib.request.Request(self.webhook_url, data=body, method="POST",
                                         headers={"Content-Type": "application/json", **(headers or {})})
        if token is not None:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status, json.loads(reply.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    # ---- cleanup -------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the launchers the daemon started (by their records: pid and start time)."""
        records = []
        for path in (self.home / "daemon" / "launchers").glob("*.json"):
            try:
                records.append(json.loads(path.read_text()))
            except ValueError:
                continue
        stop_recorded_launchers(records)


def _spec(path: Path, name: str, ckpt: Path) -> Path:
    fields = {"name": name, "nnodes": "1", "nproc_per_node": 2, "checkpoint_dir": str(ckpt), "max_restarts": 0,
              "command": ["-m", "trainwarden.runtime.examples.gpt", "--batch", "4", "--steps", "30",
                          "--ckpt-every", "5"],
              }
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items())
                    + 'env = { TRAINWARDEN_FAULTS = "crash:rank=1,step=14" }\n')
    return path


def _iso(text: str) -> float:
    whole, _, frac = text.rstrip("Z").partition(".")
    return calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S")) + float(f"0.{frac or 0}")


def run_failed_job(bed: AlertingBed, job: str, *, resume_directly: bool = False) -> dict[str, float]:
    """Submit a job that crashes at step 14 with no restart left, wait for it to be resumed (by the alert path,
    or with ``resume_directly`` by this function the moment it sees the failure: the baseline of a human who
    never sleeps) and to finish; the timings in seconds, from the failure to the first step after the resume."""
    host, _, port = bed.etcd.rpartition(":")
    client = open_client(host, int(port), timeout=5.0)
    watch = PhaseWatch(client, job_key(job, "state")).start()
    try:
        out = subprocess.run([sys.executable, "-m", "trainwarden.agent.cli", "submit",
                              str(_spec(bed.tmp / f"{job}.toml", job, bed.tmp / f"ckpt-{job}")), "--etcd", bed.etcd],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        wait_for(lambda: watch.first(1, "failed") is not None, 240, what="generation 1 to fail at step 14")
        if resume_directly:
            JobControl(client).resume(job, by="bench")
        wait_for(lambda: watch.first(2, "pending") is not None, 120,
                 what="the alert to resume the job:\n" + bed.daemon_log()[-2000:])
        first_step: list[float] = []

        def resumed_and_stepped():
            log = bed.job_log(job)
            after = log[log.find(RESUMED):] if RESUMED in log else ""
            if steps(after) and not first_step:
                first_step.append(time.time())
            return watch.first(2, "succeeded") is not None or watch.first(2, "failed") is not None

        wait_for(resumed_and_stepped, 240, interval=0.1, what="generation 2 to finish:\n" + bed.job_log(job)[-3000:])
        assert watch.first(2, "succeeded") is not None, bed.job_log(job)[-3000:]
        records = [json.loads(v) for v, _ in client.get_prefix(job_key(job, "autoresume", ""))]
    finally:
        watch.stop()
        client.close()
    failed = watch.first(1, "failed").at
    first = first_step[0] if first_step else float("nan")
    if resume_directly:
        return {"resume": first - watch.first(2, "pending").at, "total": first - failed}
    (record,) = records
    fired = _iso(record["startsAt"])
    return {"failed": failed, "rule": fired - failed, "alertmanager": record["received_at"] - fired,
            "webhook": record["at"] - record["received_at"],
            "resume": first - record["at"], "total": first - failed}


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=3) as reply:
            return reply.read().decode()
    except OSError:
        return None


def steps(text: str) -> list[int]:
    return [int(n) for n in STEP.findall(text)]


def payload(job: str, generation: int | None, *, status: str = "firing", action: str | None = "resume",
            alertname: str = "TrainwardenJobFailed") -> dict:
    """An Alertmanager version 4 payload with one alert, as Alertmanager 0.25 sends it."""
    labels = {"alertname": alertname, "job": job, "severity": "critical"}
    if generation is not None:
        labels["generation"] = str(generation)
    if action is not None:
        labels["trainwarden_action"] = action
    now = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
    return {"receiver": "trainwarden-resume", "status": status, "version": "4",
            "groupKey": '{}/{trainwarden_action="resume"}:{generation="%s", job="%s"}' % (generation, job),
            "truncatedAlerts": 0, "groupLabels": {"job": job}, "commonLabels": labels, "commonAnnotations": {},
            "externalURL": "http://127.0.0.1:9093",
            "alerts": [{"status": status, "labels": labels, "annotations": {"summary": "test"}, "startsAt": now,
                        "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "", "fingerprint": "0123456789abcdef"}]}

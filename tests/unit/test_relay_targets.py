"""What the root daemon fetches for a job (issue 44, item 3): only ``http://127.0.0.1:<port>/metrics``, read from
a record it opens without following links, within a time and size bound. Real sockets, the real ``LauncherRelay``
and the daemon's own ``_relay`` over a real state directory, as a job's user would leave it."""

from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from trainwarden.agent.metrics import build_registry
from trainwarden.agent.metrics.launcher_fetch import DEFAULT_MAX_BODY_BYTES, TargetRefused, fetch_metrics, launcher_target, read_record
from trainwarden.agent.metrics.relay import LauncherRelay
from trainwarden.agent.node.daemon import _relay
from trainwarden.agent.node.endpoints import AGENT_METRICS_RECORD

pytestmark = pytest.mark.timeout(60)

SECRET = "root-only-secret-7f3a9c"
BODY = '# TYPE trainwarden_last_step gauge\ntrainwarden_last_step{job="a",rank="0"} 5.0\n'


class Target:
    """A loopback TCP server that misbehaves as told: ``silent`` accepts and never answers, ``stream`` answers a
    200 and then sends without end, ``dribble`` sends a byte at a time forever, ``ok`` answers ``BODY``."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.stop = threading.Event()
        self.sent = 0
        self.closed_by_client = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(0.2)
            try:
                if self.mode == "ok":
                    conn.recv(4096)
                    conn.sendall(f"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n{BODY}".encode())
                    return
                if self.mode == "stream":
                    conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n")
                while not self.stop.is_set():
                    if self.mode == "silent":
                        try:
                            if conn.recv(4096) == b"":
                                break
                        except socket.timeout:
                            continue
                    else:
                        chunk = b"# x\n" * 16384 if self.mode == "stream" else b"#"
                        conn.sendall(chunk)
                        self.sent += len(chunk)
                        if self.mode == "dribble":
                            self.stop.wait(0.1)
            except OSError:
                pass
            self.closed_by_client.set()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


@pytest.fixture
def target(request):
    servers = []

    def make(mode: str) -> Target:
        servers.append(Target(mode))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def scrape(relay: LauncherRelay) -> str:
    return generate_latest(build_registry([relay])).decode()


@pytest.mark.parametrize("url, what", [
    ("file:///etc/shadow", "scheme"), ("http://10.0.0.1:80/metrics", "not loopback"),
    ("http://localhost:9/metrics", "not loopback"), ("http://127.0.0.1:0/metrics", "port 0"),
    ("http://127.0.0.1:70000/metrics", "port"), ("http://127.0.0.1:9/other", "path"),
    ("http://127.0.0.1:9/metrics?x=1", "path"), ("http://u:p@127.0.0.1:9/metrics", "user"),
    ("http://127.0.0.1/metrics", "no port"), ("gopher://[::1]:9/metrics", "scheme"),
])
def test_only_a_loopback_metrics_url_is_a_target(url, what):
    with pytest.raises(TargetRefused, match=what):
        launcher_target(url)
    assert launcher_target("http://127.0.0.1:9478/metrics") == ("127.0.0.1", 9478)
    assert launcher_target("http://[::1]:1/metrics") == ("::1", 1)


def state_dir(tmp_path: Path, job: str = "a") -> Path:
    path = tmp_path / "jobs" / job
    path.mkdir(parents=True)
    return path


def daemon_relay(tmp_path: Path, jobs=("a",)) -> LauncherRelay:
    runner = SimpleNamespace(launchers=lambda: list(jobs))
    return _relay(runner, SimpleNamespace(state_home=str(tmp_path), node="n1"))


def test_a_recorded_file_url_is_never_read(tmp_path, caplog):
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    (state_dir(tmp_path) / AGENT_METRICS_RECORD).write_text(f"file://{secret}\n")
    relay = daemon_relay(tmp_path)
    with caplog.at_level(logging.DEBUG):
        first, second = scrape(relay), scrape(relay)
    assert SECRET not in first + second + caplog.text
    assert 'trainwarden_job_metrics_up{job="a",node="n1"} 0.0' in first
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1 and "scheme is 'file'" in refusals[0].getMessage()  # once per job, what was wrong


def test_a_record_that_is_a_link_or_a_fifo_is_refused_without_blocking(tmp_path, caplog):
    secret = tmp_path / "secret"
    secret.write_text("http://127.0.0.1:1/metrics\n")
    (state_dir(tmp_path, "a") / AGENT_METRICS_RECORD).symlink_to(secret)
    os.mkfifo(state_dir(tmp_path, "b") / AGENT_METRICS_RECORD)  # an open without O_NONBLOCK waits for a writer
    big = state_dir(tmp_path, "c") / AGENT_METRICS_RECORD
    big.write_text("http://127.0.0.1:1/metrics" + " " * 4096)
    relay = daemon_relay(tmp_path, jobs=("a", "b", "c"))
    with caplog.at_level(logging.WARNING):
        text = scrape(relay)
    for job in "abc":
        assert f'trainwarden_job_metrics_up{{job="{job}",node="n1"}} 0.0' in text
    said = caplog.text
    assert "symbolic link" in said and "not a regular file" in said and "bytes" in said
    with pytest.raises(TargetRefused):
        read_record(tmp_path / "jobs" / "b", AGENT_METRICS_RECORD)
    assert read_record(tmp_path / "jobs" / "none", AGENT_METRICS_RECORD) is None


@pytest.mark.timeout(20)
def test_a_target_that_streams_forever_is_cut_at_the_bound(target):
    endless = target("stream")
    relay = LauncherRelay(lambda: {"a": endless.url}, node="n1")  # the defaults: 8 MiB, 3 s in all
    before = threading.active_count()
    text = scrape(relay)
    assert 'trainwarden_job_metrics_up{job="a",node="n1"} 0.0' in text
    assert endless.closed_by_client.wait(10)  # the daemon hung up, having read about the bound
    assert endless.sent < 2 * DEFAULT_MAX_BODY_BYTES  # the bound, and what fits in the socket buffers beyond it
    assert threading.active_count() <= before + 1  # the target's own answering thread may still be ending


@pytest.mark.timeout(20)
@pytest.mark.parametrize("mode", ["silent", "dribble"])
def test_a_target_that_never_answers_whole_costs_the_timeout_and_no_thread(target, mode):
    stuck = target(mode)
    relay = LauncherRelay(lambda: {"a": stuck.url}, node="n1")  # the defaults: 1 s a read, 3 s in all
    baseline = {t.ident for t in threading.enumerate()}
    text = scrape(relay)  # returns: the deadline, not the target, ends the fetch
    assert 'trainwarden_job_metrics_up{job="a",node="n1"} 0.0' in text
    assert stuck.closed_by_client.wait(10)
    left = [t for t in threading.enumerate() if t.ident not in baseline and t.name.startswith("trainwarden-relay")]
    assert left == []
    with pytest.raises(TimeoutError):
        fetch_metrics(stuck.url, 0.5, deadline_s=1.0)


def test_an_allowed_target_is_relayed(target, tmp_path):
    ok = target("ok")
    (state_dir(tmp_path) / AGENT_METRICS_RECORD).write_text(ok.url + "\n")
    text = scrape(daemon_relay(tmp_path))
    assert 'trainwarden_last_step{job="a",rank="0"} 5.0' in text
    assert 'trainwarden_job_metrics_up{job="a",node="n1"} 1.0' in text

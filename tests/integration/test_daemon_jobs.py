"""The node daemon runs submitted jobs (issue 11): real etcd on loopback, real `trainwarden agent` daemons, real
`trainwarden run` launchers, torchrun and gloo workers of the reference GPT.

The daemon starts each launcher in a session of its own, so that the daemon's death never reaches it; the tests
therefore stop launchers by their records (``<state home>/daemon/launchers``) as well as through the process
group of what they started.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from local_prometheus import available as prometheus_available, query, start_prometheus
from procs import stop_recorded_launchers, wait_for
from trainwarden.agent.etcd.embedded import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

STEP = re.compile(r"\[rank 0\] [\w.]+: step (\d+) loss")


def _cli(*args: str, etcd: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainwarden.agent.cli", *args, "--etcd", etcd],
                          capture_output=True, text=True, timeout=timeout)


def _spec(path: Path, name: str, steps: int, ckpt: Path, **extra) -> Path:
    fields = {"name": name, "command": ["-m", "trainwarden.runtime.examples.gpt", "--batch", "4", "--steps",
                                        str(steps), "--ckpt-every", "10"],
              "nnodes": "1", "nproc_per_node": 2, "checkpoint_dir": str(ckpt), "max_restarts": 1, **extra}
    lines = [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


class Daemons:
    """`trainwarden agent` per simulated node (loopback, own state home and socket), and cleanup of every
    launcher they started, adopted or not."""

    def __init__(self, procs, tmp_path: Path, etcd: str) -> None:
        self.procs, self.tmp, self.etcd = procs, Path(tmp_path), etcd
        self.running: dict[str, subprocess.Popen] = {}

    def home(self, node: str) -> Path:
        return self.tmp / node

    def start(self, node: str, *, users: tuple[str, ...] = ("--job-user", str(os.getuid()), "--allow-root-jobs"),
              wrap: tuple[str, ...] = ()) -> subprocess.Popen:
        """``users``: who the jobs run as (default: as the test does); ``wrap``: a command the daemon runs under."""
        home = self.home(node)
        home.mkdir(parents=True, exist_ok=True)
        proc = self.procs.spawn([*wrap, sys.executable, "-m", "trainwarden.agent.cli", "agent", "--etcd", self.etcd,
                                 "--node", node, "--state-home", str(home), "--socket", str(home / "agent.sock"),
                                 "--metrics-host", "127.0.0.1", "--metrics-port", "0", "--local-addr", "127.0.0.1",
                                 *users], log=home / "daemon.log", env=dict(os.environ))
        self.running[node] = proc
        # Not just "serving": the exporter's own "serving Prometheus metrics" line comes first (a CI failure).
        wait_for(lambda: f"agent {node} serving:" in self.log(node) or proc.poll() is not None, 60, what=f"daemon {node} to serve")
        assert proc.poll() is None, self.log(node)[-3000:]
        return proc

    def log(self, node: str) -> str:
        path = self.home(node) / "daemon.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def job_log(self, node: str, job: str) -> str:
        path = self.home(node) / "daemon" / "logs" / f"{job}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def launchers(self, node: str) -> dict[str, dict]:
        found = {}
        for path in (self.home(node) / "daemon" / "launchers").glob("*.json"):
            try:
                found[path.stem] = json.loads(path.read_text())
            except ValueError:
                continue
        return found

    def close(self) -> None:
        homes = {p.parent.parent.parent.name for p in self.tmp.glob("*/daemon/launchers/*.json")}
        stop_recorded_launchers(rec for node in set(self.running) | homes for rec in self.launchers(node).values())


@pytest.fixture
def daemons(procs, tmp_path, etcd_server):
    d = Daemons(procs, tmp_path, etcd_server.endpoint)
    try:
        yield d
    finally:
        d.close()


def _jobs(etcd: str) -> dict[str, dict]:
    out = _cli("jobs", "--json", etcd=etcd)
    assert out.returncode == 0, out.stderr
    return {j["job"]: j for j in json.loads(out.stdout)}


def _steps(text: str) -> list[int]:
    return [int(n) for n in STEP.findall(text)]


def test_a_submitted_job_runs_on_its_node_outlives_a_killed_daemon_and_is_adopted_not_launched_twice(
        daemons, tmp_path, etcd_server):
    etcd = etcd_server.endpoint
    daemons.start("n0")
    spec = _spec(tmp_path / "dj.toml", "dj", 60, tmp_path / "ckpt", nodes=["n0"])
    out = _cli("submit", str(spec), etcd=etcd)
    assert out.returncode == 0 and "submitted job dj (generation 1)" in out.stdout, out.stderr
    wait_for(lambda: max(_steps(daemons.job_log("n0", "dj")) or [0]) >= 10, 180, what="the job to reach step 10")
    (launcher,) = daemons.launchers("n0").values()
    assert _jobs(etcd)["dj"]["phase"] == "running" and list(_jobs(etcd)["dj"]["nodes"]) == ["n0"]

    daemons.procs.kill(daemons.running["n0"])  # SIGKILL: no cleanup of any kind
    daemons.running["n0"].wait(10)
    at_kill = max(_steps(daemons.job_log("n0", "dj")))
    wait_for(lambda: max(_steps(daemons.job_log("n0", "dj"))) >= at_kill + 5, 60,
             what="training to go on without the daemon")
    assert psutil.pid_exists(launcher["pid"])

    daemons.start("n0")
    wait_for(lambda: f"adopted its running launcher (pid {launcher['pid']})" in daemons.log("n0"), 30,
             what="the new daemon to adopt the launcher")
    wait_for(lambda: _jobs(etcd)["dj"]["phase"] == "succeeded", 240, what="the job to succeed")
    text = daemons.job_log("n0", "dj")
    assert _steps(text) == list(range(1, 61)), "a step ran twice or never: the job was restarted"
    assert text.count("starts job dj") == 1, "launched twice"
    assert "started its launcher" not in daemons.log("n0").split("adopted its running launcher")[1]
    nodes = json.loads(_cli("nodes", "--json", etcd=etcd).stdout)
    assert nodes["n0"]["record"]["health"] == "ok"


def test_a_node_that_lost_power_mid_job_takes_its_part_again_when_its_daemon_comes_back(daemons, tmp_path, etcd_server):
    """The daemon, the launcher and the workers all SIGKILLed at once (what a power loss leaves: a launcher record
    whose process is gone, a job still live in etcd). The daemon that comes back must start this node's part again
    from its checkpoint, not take the job for finished here (found by the soak's daemon-run variant, session 36)."""
    etcd = etcd_server.endpoint
    daemons.start("n0")
    spec = _spec(tmp_path / "pl.toml", "pl", 40, tmp_path / "ckpt", nodes=["n0"])
    assert _cli("submit", str(spec), etcd=etcd).returncode == 0
    wait_for(lambda: max(_steps(daemons.job_log("n0", "pl")) or [0]) >= 12, 180, what="the job past its step-10 save")
    (launcher,) = daemons.launchers("n0").values()
    tree = [psutil.Process(daemons.running["n0"].pid), psutil.Process(launcher["pid"])]
    tree += psutil.Process(launcher["pid"]).children(recursive=True)
    for p in tree:  # all at once, no order: nothing gets to clean up
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(tree, timeout=10)
    assert _jobs(etcd)["pl"]["phase"] in ("running", "restarting")

    daemons.start("n0")
    wait_for(lambda: "starting it again" in daemons.log("n0"), 30, what="the daemon to start the job's part again")
    wait_for(lambda: _jobs(etcd)["pl"]["phase"] == "succeeded", 240, what="the job to succeed")
    text = daemons.job_log("n0", "pl")
    assert text.count("starts job pl") == 2
    assert re.search(r"resumed from (checkpoint step|the memory snapshots? of step) 1\d", text), text[-3000:]
    assert max(_steps(text)) == 40
    assert f"its launcher (pid {launcher['pid']}) ended while the daemon was away" in daemons.log("n0")


def test_a_node_that_lost_power_with_no_restart_left_stays_out_and_its_daemon_says_why(daemons, tmp_path, etcd_server):
    """The same power loss under ``max_restarts = 0``: the budget a killed launcher has is spent, so the daemon that
    comes back does not start the job's part again, and says so."""
    etcd = etcd_server.endpoint
    daemons.start("n0")
    spec = _spec(tmp_path / "pz.toml", "pz", 400, tmp_path / "ckpt", nodes=["n0"], max_restarts=0)
    assert _cli("submit", str(spec), etcd=etcd).returncode == 0
    wait_for(lambda: max(_steps(daemons.job_log("n0", "pz")) or [0]) >= 2, 180, what="the job to train")
    (launcher,) = daemons.launchers("n0").values()
    tree = [psutil.Process(daemons.running["n0"].pid), psutil.Process(launcher["pid"])]
    tree += psutil.Process(launcher["pid"]).children(recursive=True)
    for p in tree:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(tree, timeout=10)

    daemons.start("n0")
    wait_for(lambda: "restart(s) on this node are spent" in daemons.log("n0"), 30, what="the daemon to say why")
    assert f"its launcher (pid {launcher['pid']}) ended while the daemon was away; its 0 restart(s)" in daemons.log("n0")
    time.sleep(3)  # a round or more of the runner
    assert daemons.launchers("n0") == {} and daemons.job_log("n0", "pz").count("starts job pz") == 1


@pytest.mark.skipif(not prometheus_available(), reason="prometheus not installed (apt-get install prometheus)")
def test_prometheus_scraping_the_daemon_alone_sees_the_step_series_of_the_job_it_runs(daemons, tmp_path, etcd_server):
    """What deploy/prometheus.yml does (the node's daemon is the only target, honor_labels) is enough to see a
    daemon-run job: its launcher's own endpoint is on a port nobody lists."""
    etcd = etcd_server.endpoint
    daemons.start("n0")
    daemon_target = re.search(r"metrics http://(127\.0\.0\.1:\d+)/metrics", daemons.log("n0")).group(1)
    prom_port = free_port()
    start_prometheus(daemons.procs, tmp_path / "prometheus", [daemon_target], port=prom_port)
    spec = _spec(tmp_path / "pm.toml", "pm", 2000, tmp_path / "ckpt", nodes=["n0"])
    assert _cli("submit", str(spec), etcd=etcd).returncode == 0

    def steps_seen() -> list[dict]:
        try:
            return query(prom_port, 'trainwarden_last_step{job="pm", node="n0"} > 5')
        except (OSError, ValueError, AssertionError):  # Prometheus still starting
            return []

    wait_for(lambda: len(steps_seen()) == 2, 240, interval=1.0, what="Prometheus to see both ranks of pm past step 5")
    assert query(prom_port, 'trainwarden_job_metrics_up{job="pm", node="n0"} == 1')
    assert len(query(prom_port, 'trainwarden_step_duration_seconds_count{job="pm", node="n0"} > 0')) == 2
    assert _cli("stop", "pm", etcd=etcd).returncode == 0
    wait_for(lambda: _jobs(etcd)["pm"]["phase"] == "stopped", 90, what="the job to stop")


def test_stop_resume_relaunch_cordon_drain_and_the_requests_that_do_not_fit(daemons, tmp_path, etcd_server):
    etcd = etcd_server.endpoint
    daemons.start("n0")
    spec = _spec(tmp_path / "long.toml", "long", 5000, tmp_path / "ckpt")
    assert _cli("cordon", "n0", "--reason", "fan replacement", etcd=etcd).returncode == 0
    assert _cli("submit", str(spec), etcd=etcd).returncode == 0
    wait_for(lambda: "it is cordoned: not starting it" in daemons.log("n0"), 30, what="the cordon to hold the job")
    assert daemons.launchers("n0") == {}
    assert "fan replacement" in _cli("nodes", etcd=etcd).stdout
    assert _cli("uncordon", "n0", etcd=etcd).returncode == 0
    uncordoned = time.time()
    wait_for(lambda: max(_steps(daemons.job_log("n0", "long")) or [0]) >= 12, 180, what="the job to train")

    again = _cli("submit", str(spec), etcd=etcd)
    assert again.returncode == 2 and "is running" in again.stderr and "trainwarden stop long" in again.stderr
    early = _cli("resume", "long", etcd=etcd)
    assert early.returncode == 2 and "not failed or stopped" in early.stderr

    stop = _cli("stop", "long", etcd=etcd)
    assert stop.returncode == 0 and "asked the nodes running job long to stop it" in stop.stdout
    wait_for(lambda: _jobs(etcd)["long"]["phase"] == "stopped", 60, what="the job to stop")
    wait_for(lambda: daemons.launchers("n0") == {}, 30, what="the launcher to exit")
    assert _cli("stop", "long", etcd=etcd).returncode == 2

    resumed = _cli("resume", "long", etcd=etcd)
    assert resumed.returncode == 0 and "generation 2" in resumed.stdout, resumed.stderr
    wait_for(lambda: "resumed from checkpoint step" in daemons.job_log("n0", "long"), 180,
             what="the resumed generation to restore its checkpoint")
    # the OOM killer takes the launcher (its workers die with it): the daemon starts it again, within max_restarts
    (first,) = daemons.launchers("n0").values()
    os.kill(first["pid"], signal.SIGKILL)
    wait_for(lambda: (daemons.launchers("n0").get("long") or {}).get("pid", first["pid"]) != first["pid"], 60,
             what="the daemon to start the launcher again")
    assert daemons.launchers("n0")["long"]["relaunches"] == 1
    assert "was killed; starting it again (1 of 1)" in daemons.log("n0")
    wait_for(lambda: daemons.job_log("n0", "long").count("[rank 0] trainwarden.runtime.examples.gpt: resumed from") >= 2,
             120, what="the new launcher to resume from the checkpoint")
    # draining the only node of a job: it checkpoints at a step boundary and stops, resumable from there
    drain = _cli("drain", "n0", "--reason", "kernel upgrade", etcd=etcd)
    assert drain.returncode == 0, drain.stderr
    wait_for(lambda: _jobs(etcd)["long"]["phase"] == "stopped", 120, what="the drained job to stop")
    job = _jobs(etcd)["long"]
    assert job["reason"].startswith("drained after the checkpoint of step"), job
    assert str(job["checkpoint"]["step"]) in job["reason"]
    # one goodput ledger across the job's three launchers (a stop, a resume, a killed launcher): its wall time
    # reaches back to the first launch, and the time no launcher ran the job is badput "stopped"
    goodput = job["goodput"]
    assert goodput is not None and goodput["productive_s"] > 0 and goodput["badput_s"]["stopped"] > 0, goodput
    assert time.time() - uncordoned - 30 < goodput["wall_s"] < time.time() - uncordoned, goodput
    incidents = list((daemons.home("n0") / "daemon" / "records" / "long" / "incidents").glob("*.json"))
    cordoned = [json.loads(p.read_text()) for p in incidents if json.loads(p.read_text())["kind"] == "cordoned"]
    assert cordoned and cordoned[0]["evidence"]["reason"] == "kernel upgrade" and cordoned[0]["evidence"]["drain"]


@pytest.mark.slow
@pytest.mark.extended
def test_etcd_away_for_a_minute_stops_nothing_and_the_daemon_catches_up(daemons, tmp_path, etcd_server):
    etcd = etcd_server.endpoint
    daemons.start("n0")
    spec = _spec(tmp_path / "eo.toml", "eo", 100000, tmp_path / "ckpt")
    assert _cli("submit", str(spec), etcd=etcd).returncode == 0
    wait_for(lambda: max(_steps(daemons.job_log("n0", "eo")) or [0]) >= 10, 180, what="the job to train")
    (launcher,) = daemons.launchers("n0").values()
    etcd_server.stop()
    try:
        before = max(_steps(daemons.job_log("n0", "eo")))
        time.sleep(60)
        assert psutil.pid_exists(launcher["pid"]) and daemons.running["n0"].poll() is None
        assert max(_steps(daemons.job_log("n0", "eo"))) > before + 20, "training stalled while etcd was away"
        assert "cannot read the jobs from etcd" in daemons.log("n0")
    finally:
        etcd_server.start()
    wait_for(lambda: "etcd answers again" in daemons.log("n0"), 60, what="the daemon to catch up")
    wait_for(lambda: (json.loads(_cli("nodes", "--json", etcd=etcd).stdout).get("n0") or {}).get("record"), 30,
             what="the node record to be written again")
    assert daemons.launchers("n0")["eo"]["pid"] == launcher["pid"]  # the same launcher: nothing restarted
    assert _cli("stop", "eo", etcd=etcd).returncode == 0
    wait_for(lambda: _jobs(etcd)["eo"]["phase"] == "stopped", 60, what="the job to stop")


RANK0 = re.compile(r"^(\S+ \S+) \[rank 0\] [\w.]+: (?:step (\d+) loss|resumed from checkpoint step (\d+))", re.M)


def _story(text: str) -> list[tuple[str, str, int]]:
    """Rank 0's steps and resumes in time order, from every node's log: (time, "step"/"resumed", n)."""
    return sorted((m.group(1), "step" if m.group(2) else "resumed", int(m.group(2) or m.group(3)))
                  for m in RANK0.finditer(text))


def _no_step_lost(story: list[tuple[str, str, int]], step: int) -> None:
    """The last resume was from ``step`` and nothing computed before it came after ``step``."""
    last = max(i for i, e in enumerate(story) if e[1] == "resumed")
    assert story[last][2] == step, story[last]
    lost = [n for _, k, n in story[:last] if k == "step" and n > step]
    assert lost == [], f"steps computed before the checkpoint of step {step} and again after it: {lost}"


def test_a_gpu_fault_drains_its_node_and_a_straggler_exclusion_takes_another_out_with_no_step_lost(
        daemons, tmp_path, etcd_server, etcd_client):
    """n2's daemon runs in this process on a fake NVML; an XID 79 on its GPU 0 makes it cordon and drain itself.
    Then n1's exclusion (what its watchdog writes under straggler policy ``exclude``) takes n1 out. Each time
    the node leaves after a checkpoint at an agreed step and the others resume from it: nothing is lost."""
    from fake_nvml import FakeGpu, FakeNvml
    from trainwarden.agent.health import GpuHealthConfig, GpuHealthSampler
    from trainwarden.agent.node.job_runner import JobRunner

    etcd = etcd_server.endpoint
    for node in ("n0", "n1", "n3"):  # n3 is not among the job's nodes: it must never run it
        daemons.start(node)
    nvml = FakeNvml([FakeGpu(uuid="GPU-aaaa")])
    gpus = GpuHealthSampler(GpuHealthConfig(node="n2", interval_s=0.2, xid_wait_s=0.1), nvml=nvml)
    gpus.start()
    incidents = []
    runner = JobRunner(etcd_client, node="n2", etcd=etcd, state_home=daemons.home("n2"), local_addr="127.0.0.1",
                       health=gpus.unhealthy_reasons, record=lambda i: incidents.append(i) or i, interval_s=1.0,
                       default_user=str(os.getuid()), allow_root_jobs=True)  # the jobs run as the test does
    runner.start()
    try:
        spec = _spec(tmp_path / "gf.toml", "gf", 100000, tmp_path / "ckpt", nnodes="1:3", nproc_per_node=1,
                     nodes=["n0", "n1", "n2"],
                     # a global batch of 12 in micro-batches of 2: dp 3, 2 and 1 divide it, the samples stay
                     command=["-m", "trainwarden.runtime.examples.gpt", "--batch", "12", "--micro-batch-size", "2",
                              "--steps", "100000", "--ckpt-every", "10"])
        assert _cli("submit", str(spec), etcd=etcd).returncode == 0

        def text() -> str:
            return "".join(daemons.job_log(n, "gf") for n in ("n0", "n1", "n2"))

        wait_for(lambda: len(_jobs(etcd)["gf"]["nodes"]) == 3, 120, what="three nodes in the job")
        joined = max(_steps(text()) or [0])
        wait_for(lambda: max(_steps(text()) or [0]) >= joined + 15, 240, what="the job to train on three nodes")

        def cluster_view():
            (job,) = json.loads(_cli("status", "--job", "gf", "--json", etcd=etcd).stdout)
            return job if all(n["ranks"] and n["last_step"] > 0 and n["connected"] == 1 for n in job["nodes"]) \
                and [n["node"] for n in job["nodes"]] == ["n0", "n1", "n2"] else None

        view = wait_for(cluster_view, 30, what="`status --etcd` to show the three nodes' ranks")
        assert view["phase"] == "running" and sorted(r for n in view["nodes"] for r in n["ranks"]) == [0, 1, 2]

        nvml.push_xid(0, 79)  # GPU 0 fell off the bus
        wait_for(lambda: "node n2 left job gf after the checkpoint of step" in daemons.job_log("n2", "gf"), 120,
                 what="n2 to leave the job")
        cordon = json.loads(_cli("nodes", "--json", etcd=etcd).stdout)["n2"]["cordon"]
        assert cordon["drain"] and "GPU fault: gpu 0: XID 79 (GPU has fallen off the bus)" in cordon["reason"]
        assert [(i.kind.value, i.job) for i in incidents] == [("cordoned", "gf")]
        gauges = {(m.name, s.labels.get("kind")): s.value for m in runner.collect() for s in m.samples}
        assert gauges[("trainwarden_node_cordoned", "drain")] == 1 and gauges[("trainwarden_node_cordoned", "cordon")] == 0
        left_at = int(re.search(r"n2 left job gf after the checkpoint of step (\d+)", text()).group(1))
        wait_for(lambda: any(k == "resumed" and n == left_at for _, k, n in _story(text())), 120,
                 what="n0 and n1 to resume from the drain's checkpoint")
        wait_for(lambda: max(_steps(text())) >= left_at + 5, 120, what="training on two nodes")
        _no_step_lost(_story(text()), left_at)
        assert sorted(_jobs(etcd)["gf"]["nodes"]) == ["n0", "n1"]

        etcd_client.put("/trainwarden/v1/jobs/gf/exclude/n1", json.dumps({"reason": "rank 1 straggles: 1.5x"}))
        wait_for(lambda: "node n1 left job gf after the checkpoint of step" in daemons.job_log("n1", "gf"), 120,
                 what="the excluded node to leave")
        assert "is to be left out of job gf (straggler policy exclude)" in daemons.job_log("n1", "gf")
        out_at = int(re.search(r"n1 left job gf after the checkpoint of step (\d+)", text()).group(1))
        wait_for(lambda: any(k == "resumed" and n == out_at for _, k, n in _story(text())), 120,
                 what="n0 to resume alone from the exclusion's checkpoint")
        wait_for(lambda: max(_steps(text())) >= out_at + 5, 120, what="training on one node")
        _no_step_lost(_story(text()), out_at)
        assert sorted(_jobs(etcd)["gf"]["nodes"]) == ["n0"]
        time.sleep(3)  # the excluded node's daemon does not start it again
        assert "n1" not in _jobs(etcd)["gf"]["nodes"] and daemons.launchers("n1") == {}
        assert daemons.job_log("n3", "gf") == "" and "job gf" not in daemons.log("n3")
        assert _cli("stop", "gf", etcd=etcd).returncode == 0
        wait_for(lambda: _jobs(etcd)["gf"]["phase"] == "stopped", 90, what="the job to stop")
    finally:
        runner.stop()
        gpus.stop()


RECORD_PLANTER = """
import os, pathlib, time
state = pathlib.Path(os.environ["TRAINWARDEN_STATE_DIR"])
while True:  # the launcher records its own URL at start; the job's code replaces it, as its user may
    (state / "agent.metrics.url").write_text("file://SECRET_PATH\\n")
    time.sleep(0.5)
"""


def test_a_job_that_records_a_file_url_gets_nothing_read_by_the_daemon(daemons, tmp_path, etcd_server):
    """Issue 44, item 3, against a real daemon: the job's code points the daemon's relay at a file; the daemon
    refuses the record (one log line saying why) and neither its log nor its scrape holds the file's content."""
    import urllib.request

    etcd = etcd_server.endpoint
    secret = tmp_path / "secret"
    secret.write_text("root-only-secret-5be1\n")
    secret.chmod(0o600)
    script = tmp_path / "planter.py"
    script.write_text(RECORD_PLANTER.replace("SECRET_PATH", str(secret)))
    daemons.start("n0")
    metrics = re.search(r"metrics (http://127\.0\.0\.1:\d+/metrics)", daemons.log("n0")).group(1)
    spec = _spec(tmp_path / "rl.toml", "rl", 1, tmp_path / "ckpt", nodes=["n0"], nproc_per_node=1,
                 command=[str(script)])
    assert _cli("submit", str(spec), etcd=etcd).returncode == 0

    def scrape() -> str:
        return urllib.request.urlopen(metrics, timeout=30).read().decode()

    wait_for(lambda: scrape() and "recorded metrics target is refused" in daemons.log("n0"), 180, interval=1.0,
             what="the daemon to refuse the planted record")
    text = scrape()
    assert 'trainwarden_job_metrics_up{job="rl",node="n0"} 0.0' in text
    assert "scheme is 'file'" in daemons.log("n0")
    assert "root-only-secret-5be1" not in text + daemons.log("n0")
    assert _cli("stop", "rl", etcd=etcd).returncode == 0
    wait_for(lambda: _jobs(etcd)["rl"]["phase"] == "stopped", 90, what="the job to stop")

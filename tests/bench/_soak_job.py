"""The soak's job on the bed (tests/bench/soak.py): one `trainwarden run` per node (or one node daemon per node, the job
submitted to them), what its logs say, which process trains a rank, and the agents' and launchers' resources
sampled as it runs."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from testbed import TestBed

JOB = "soak"
NODES = ("n0", "n1")
TS = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
STEP = re.compile(rf"^{TS} \[rank \d+\] [\w.]+: step (\d+) loss (\S+) time", re.M)
RESUMED = re.compile(rf"^{TS} \[rank 0\] [\w.]+: resumed from (?:checkpoint step|the memory snapshots? of step) "
                     r"(\d+)", re.M)
COMMIT = re.compile(rf"^{TS} .*checkpoint step (\d+) committed: (\S+) ", re.M)
SHRANK = re.compile(r"world size 8, now 4|taken at world size 8")
TIMED = re.compile(rf"^{TS} \[rank \d+\] [\w.]+: step (\d+) loss \S+ time ([\d.]+)s", re.M)
ROUND = re.compile(rf"^{TS} \[rank 0\] [\w.]+: pipeline: \d+ stages", re.M)
"""Rank 0 starts a worker round (any world size)."""
WORLD = re.compile(rf"^{TS} \[rank 0\] [\w.]+: pipeline: (\d+ stages, \d+ micro-batches)", re.M)
"""Rank 0 starts a round, and the world's shape: dp 1 takes twice the micro-batches of dp 2."""
FULL = re.compile(rf"^{TS} \[rank 0\] [\w.]+: pipeline: 2 stages, 2 micro-batches", re.M)
"""Rank 0 starts a round of the full world (dp 2: two micro-batches of two sequences a rank; dp 1 takes four)."""
GROW_BOUND_S = 240.0
"""A node started again (or healed) must be back in the world within this long, else the fault did not recover."""


def _stamp(text: str) -> float:
    return dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


class Job:
    """The job on one bed: a `trainwarden run` per node, each start of one logged to a file of its own. With
    ``daemon``: a node daemon (`trainwarden agent`) per node instead, and the job submitted to them once both serve;
    each daemon starts its node's `trainwarden run` (and starts it again after a kill or a power loss), whose output
    goes to the daemon's job log, one file per node across its launches. ``runs`` holds what the soak started on each
    node: the `trainwarden run`, or the daemon."""

    def __init__(self, bed: TestBed, work: Path, steps: int, faults_spec: str, shm: Path, pad_s: float = 0.0,
                 daemon: bool = False) -> None:
        self.bed, self.work, self.steps, self.shm, self.pad_s = bed, work, steps, shm, pad_s
        self.faults_spec, self.daemon = faults_spec, daemon
        self.ckpt = work / "ckpt"
        self.logs: list[Path] = []
        """The job's output: the launchers' (run mode) or the daemons' job logs."""
        self.log_node: dict[Path, str] = {}
        self.daemon_logs: list[Path] = []
        self.runs: dict[str, psutil.Popen | object] = {}

    def _gpt_args(self) -> list[str]:
        return ["-m", "trainwarden.runtime.examples.gpt", "--tp", "2", "--pp", "2", "--batch", "8",
                "--micro-batch-size", "2", "--steps", str(self.steps), "--ckpt-dir", str(self.ckpt),
                "--ckpt-every", "10", "--keep", "3"] + (["--step-pad-s", f"{self.pad_s:g}"] if self.pad_s else [])

    def state(self, node: str) -> Path:
        return self.work / "state" / node

    def start(self, node: str) -> None:
        if self.daemon:
            self._start_daemon(node)
            return
        log = self.work / f"{node}-{sum(1 for p in self.logs if p.name.startswith(node))}.log"
        self.logs.append(log)
        self.log_node[log] = node
        env = dict(self._env(node, log.stem), TRAINWARDEN_STATE_HOME=str(self.state(node)))
        cmd = [sys.executable, "-m", "trainwarden.agent.cli", "run", "--metrics-port", "0", "--nnodes", "1:2",
               "--nproc-per-node", "4", "--node", node, "--max-restarts", "100", "--job", JOB,
               "--etcd", self.bed.etcd_endpoints, "--", *self._gpt_args()]
        self.runs[node] = self.bed.spawn(node, cmd, log=log, env=env)

    def _env(self, node: str, log_stem: str) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS="1", TMPDIR=str(self.work / "tmp" / node),
                   TRAINWARDEN_MEMORY_ROOT=str(self.shm / node), TRAINWARDEN_FAULTS=self.faults_spec,
                   # what the straggler detector was fed, kept with --keep: a straggler no fault explains is
                   # replayed from it (agent/watchdog/straggler_trace.py)
                   TRAINWARDEN_STRAGGLER_TRACE_DIR=str(self.work / "straggler-trace" / log_stem))
        for d in (env["TMPDIR"], env["TRAINWARDEN_MEMORY_ROOT"]):
            Path(d).mkdir(parents=True, exist_ok=True)
        return env

    def _start_daemon(self, node: str) -> None:
        """The node's daemon, with the job's environment (a root daemon running the job as root passes its own on):
        it adopts a launcher still running, starts one for a job that targets the node, and again for a launcher
        that ended while it was away while the job is live (a power loss)."""
        log = self.work / f"{node}-daemon-{sum(1 for p in self.daemon_logs if p.name.startswith(node))}.log"
        self.daemon_logs.append(log)
        env = self._env(node, log.stem)
        home = self.state(node)
        home.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "trainwarden.agent.cli", "agent", "--etcd", self.bed.etcd_endpoints, "--node",
               node, "--state-home", str(home), "--socket", str(home / "agent.sock"), "--metrics-port", "0",
               "--job-user", str(os.getuid()), "--allow-root-jobs"]
        self.runs[node] = self.bed.spawn(node, cmd, log=log, env=env)
        job_log = home / "daemon" / "logs" / f"{JOB}.log"
        if job_log not in self.logs:
            self.logs.append(job_log)
            self.log_node[job_log] = node

    def daemon_text(self, node: str) -> str:
        return "".join(p.read_text(errors="replace") for p in self.daemon_logs if p.name.startswith(f"{node}-")
                       and p.exists())

    def submit(self) -> None:
        """Once every daemon serves: the job, for both nodes, as `trainwarden submit` sends it."""
        for node in NODES:
            deadline = time.monotonic() + 90
            while f"agent {node} serving:" not in self.daemon_text(node):
                if time.monotonic() > deadline or self.runs[node].poll() is not None:
                    raise RuntimeError(f"daemon {node} did not serve: {self.daemon_text(node)[-2000:]}")
                time.sleep(0.3)
        fields = {"name": JOB, "command": self._gpt_args(), "nnodes": "1:2", "nproc_per_node": 4,
                  "nodes": list(NODES), "checkpoint_dir": str(self.ckpt), "max_restarts": 100}
        spec = self.work / "soak-job.toml"
        spec.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items()))
        out = self.bed.run(NODES[0], self._cli("submit", str(spec)), timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"trainwarden submit failed: {out.stderr.strip()[-2000:]}")

    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "trainwarden.agent.cli", *args, "--etcd", self.bed.etcd_endpoints]

    def phase(self) -> str | None:
        """The submitted job's phase in etcd, as `trainwarden jobs` says it (None: no answer)."""
        try:
            out = self.bed.run(NODES[0], self._cli("jobs", "--json"), timeout=30)
            return {j["job"]: j for j in json.loads(out.stdout)}[JOB]["phase"] if out.returncode == 0 else None
        except (subprocess.TimeoutExpired, ValueError, KeyError, TypeError):
            return None

    def launcher(self, node: str) -> int | None:
        """The pid of node ``node``'s `trainwarden run`: the daemon's record of it (daemon mode)."""
        try:
            rec = json.loads((self.state(node) / "daemon" / "launchers" / f"{JOB}.json").read_text())
            proc = psutil.Process(int(rec["pid"]))
            return proc.pid if abs(proc.create_time() - float(rec["started"])) <= 0.01 else None
        except (OSError, ValueError, KeyError, TypeError, psutil.Error):
            return None

    def text(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.logs if p.exists())

    def steps_logged(self) -> list[tuple[float, int, float]]:
        return sorted((_stamp(t), int(s), float(loss)) for t, s, loss in STEP.findall(self.text()))

    def step_runs(self) -> list[tuple[float, int, float]]:
        """Every logged run of a step: (end time, step, its duration as the logging rank timed it)."""
        return sorted((_stamp(t), int(s), float(d)) for t, s, d in TIMED.findall(self.text()))

    def round_starts(self) -> list[float]:
        return sorted(_stamp(t) for t in ROUND.findall(self.text()))

    def worlds(self) -> list[tuple[float, str]]:
        """(when, shape) of every round rank 0 started."""
        return sorted((_stamp(t), shape) for t, shape in WORLD.findall(self.text()))

    def last_step(self) -> int:
        return max((s for _, s, _ in self.steps_logged()), default=0)

    def resumed_after(self, t: float) -> float | None:
        """When rank 0 first logged a step after a resume logged after ``t``."""
        text = self.text()
        resumes = sorted(_stamp(ts) for ts, _ in RESUMED.findall(text) if _stamp(ts) > t)
        if not resumes:
            return None
        steps = [st for st, _, _ in self.steps_logged() if st > resumes[0]]
        return steps[0] if steps else None

    def full_after(self, t: float) -> float | None:
        """When rank 0 first logged a step after starting a full-world round after ``t``."""
        starts = sorted(_stamp(ts) for ts in FULL.findall(self.text()) if _stamp(ts) > t)
        steps = [st for st, _, _ in self.steps_logged() if starts and st > starts[0]]
        return steps[0] if steps else None

    def commits(self) -> list[tuple[float, int, str]]:
        return sorted({(_stamp(t), int(s), p) for t, s, p in COMMIT.findall(self.text())})

    def worker_pid(self, rank: int) -> tuple[int, str] | None:
        """The process training ``rank`` now and its node: torch's agent starts a client with RANK in its
        environment; with warm workers the zygote forks the real worker and maps it to the client in its map
        directory (runtime/zygote.py)."""
        for node in NODES:
            for pid in self.bed._pids(self.bed.hosts[node]):
                env = _environ(pid)
                if env.get("RANK") != str(rank) or env.get("TRAINWARDEN_JOB", JOB) != JOB:
                    continue
                map_dir = env.get("TRAINWARDEN_WARM_MAP_DIR")
                for entry in Path(map_dir).iterdir() if map_dir and Path(map_dir).is_dir() else []:
                    try:
                        if int(entry.read_text().split()[0]) == pid and psutil.pid_exists(int(entry.name)):
                            return int(entry.name), node
                    except (OSError, ValueError, IndexError):
                        continue
                if "examples.gpt" in " ".join(_cmdline(pid)) and not map_dir:
                    return pid, node
        return None

    def wait_exit(self, timeout: float) -> dict[str, int | str | None]:
        deadline = time.monotonic() + timeout
        if self.daemon:  # the daemons run on: the job's end is its phase in etcd, and no launcher left
            phase = None
            while time.monotonic() < deadline:
                phase = self.phase()
                if phase in ("succeeded", "failed", "stopped") and not any(self.launcher(n) for n in NODES):
                    break
                time.sleep(1.0)
            return {node: 0 if phase == "succeeded" else phase for node in NODES}
        codes = {}
        for node, proc in self.runs.items():
            try:
                codes[node] = proc.wait(max(1.0, deadline - time.monotonic()))
            except Exception:
                codes[node] = None
        return codes


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def held(pid: int) -> dict[str, int]:
    """What a process holds, by kind: its fds by target (``fd socket``, ``fd pipe``, ``fd anon_inode:[eventpoll]``, a
    file's path) and its threads by name (``thread grpc_global_tim``; Python's own threads are all named after the
    process): what a failed flat_resources names as grown."""
    kinds: dict[str, int] = {}
    root = Path(f"/proc/{pid}")
    try:
        for fd in (root / "fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            kind = target.split(":", 1)[0] if target.startswith(("socket:", "pipe:")) else target
            kinds[f"fd {kind}"] = kinds.get(f"fd {kind}", 0) + 1
        for task in (root / "task").iterdir():
            try:
                name = (task / "comm").read_text().strip()
            except OSError:
                continue
            kinds[f"thread {name}"] = kinds.get(f"thread {name}", 0) + 1
    except OSError:
        pass
    return kinds


class Sampler(threading.Thread):
    """Every ``period`` seconds: RSS, threads and fds of each node's agent (`trainwarden run`) and launcher, and in
    daemon mode of its daemon."""

    def __init__(self, job: Job, period: float = 5.0) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.job, self.period = job, period
        self.samples: list[tuple[float, str, dict]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.period):
            for node, proc in list(self.job.runs.items()):
                try:
                    if self.job.daemon:  # the daemon, and the `trainwarden run` it started or adopted
                        pid = self.job.launcher(node)
                        daemon = psutil.Process(proc.pid)
                        agent = psutil.Process(pid) if pid else None
                        targets = [("daemon", daemon)]
                    else:
                        agent = psutil.Process(proc.pid)
                        targets = []
                    if agent is not None:
                        targets += [("agent", agent)] + [("launcher", c) for c in agent.children(recursive=True)
                                                         if "trainwarden.agent.launch.elastic" in " ".join(c.cmdline())]
                    for what, p in targets:
                        with p.oneshot():
                            values = {"rss": p.memory_info().rss, "threads": p.num_threads(), "fds": p.num_fds(),
                                      "held": held(p.pid)}
                        self.samples.append((time.time(), f"{node} {what} {p.pid}", values))
                except psutil.Error:
                    continue


def fill(directory: Path) -> tuple[Path, int]:
    """Fill the file system of ``directory`` (the checkpoints' own tmpfs) with one file, to the last byte."""
    filler = directory / "soak-filler"
    written = 0
    with open(filler, "wb", buffering=0) as f:  # unbuffered: the write that does not fit fails, not the close
        for chunk in (1 << 20, 4096, 1):
            block = b"\0" * chunk
            while True:
                try:
                    written += f.write(block)
                except OSError:
                    break
    return filler, written


def corrupt(path: Path, how: str) -> str:
    """Truncate the largest file of a committed checkpoint to half, or flip one bit in its middle."""
    files = sorted((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    victim = files[-1]
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        if how == "truncate":
            f.truncate(size // 2)
            return f"{victim.relative_to(path)} {size} -> {size // 2} bytes"
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0x40]))
        return f"{victim.relative_to(path)} byte {size // 2} flipped"

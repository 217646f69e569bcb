"""Benchmark: what the node daemon costs a job, and what a drain costs.

    python tests/bench/bench_daemon.py [--runs 2] [--window 20] [--only agent-kill,drain] [--json]

Everything on loopback: one etcd, `trainwarden agent` daemons as simulated nodes (own node name, state home
and socket), the reference GPT submitted with `trainwarden submit`.

* ``agent-kill``: a one-node job of 2 ranks. Rank 0's step times (its own ``time`` field) are taken over
  ``--window`` seconds with the daemon alive, the same with the daemon SIGKILLed, and again after a new daemon
  adopted the job. Printed: the medians and the ratio of the dead and adopted windows to the alive one (the
  baseline, in the same run).
* ``drain``: a job of three nodes of one rank each (nnodes 2:3, a global batch of 12 in micro-batches of 2).
  Once it trains on three nodes, ``trainwarden drain n2``. Printed: seconds from the command to rank 0's first
  step in the two-node world, and the steps lost (computed before the checkpoint the two nodes resumed from
  and after it; the goal is 0).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))
from procs import ProcessGroup, wait_for  # noqa: E402

from trainwarden.agent.etcd.embedded import EmbeddedEtcd  # noqa: E402

RANK0 = re.compile(r"^(\S+ \S+) \[rank 0\] [\w.]+: (?:step (\d+) loss [\d.]+ time ([\d.]+)s|resumed from checkpoint "
                   r"step (\d+))", re.M)
SCENARIOS = ("agent-kill", "drain")


def _stamp(text: str) -> float:
    return dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _story(text: str) -> list[tuple[float, str, int, float]]:
    """Rank 0's (time, "step"/"resumed", step, step seconds) in time order."""
    out = []
    for m in RANK0.finditer(text):
        if m.group(2):
            out.append((_stamp(m.group(1)), "step", int(m.group(2)), float(m.group(3))))
        else:
            out.append((_stamp(m.group(1)), "resumed", int(m.group(4)), 0.0))
    return sorted(out)


class Cluster:
    def __init__(self, workdir: Path) -> None:
        self.dir, self.procs = workdir, ProcessGroup()
        self.etcd = EmbeddedEtcd(data_dir=workdir / "etcd", log_path=workdir / "etcd.log").start()
        self.daemons: dict[str, subprocess.Popen] = {}

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "trainwarden.agent.cli", *args, "--etcd", self.etcd.endpoint],
                              capture_output=True, text=True, timeout=60)

    def start(self, node: str) -> None:
        home = self.dir / node
        proc = self.procs.spawn([sys.executable, "-m", "trainwarden.agent.cli", "agent", "--etcd", self.etcd.endpoint,
                                 "--node", node, "--state-home", str(home), "--socket", str(home / "agent.sock"),
                                 "--metrics-port", "0", "--local-addr", "127.0.0.1", "--job-user", str(os.getuid()),
                                 "--allow-root-jobs"], log=home / "daemon.log")
        self.daemons[node] = proc
        wait_for(lambda: f"agent {node} serving:" in (home / "daemon.log").read_text(errors="replace"), 60, what=f"daemon {node}")

    def job_log(self, job: str) -> str:
        return "".join(p.read_text(errors="replace") for p in self.dir.glob(f"*/daemon/logs/{job}.log"))

    def nodes_of(self, job: str) -> list[str]:
        jobs = {j["job"]: j for j in json.loads(self.cli("jobs", "--json").stdout)}
        return sorted((jobs.get(job) or {}).get("nodes") or {})

    def submit(self, name: str, nnodes: str, nproc: int) -> None:
        spec = self.dir / f"{name}.toml"
        fields = {"name": name, "nnodes": nnodes, "nproc_per_node": nproc, "checkpoint_dir": str(self.dir / "ckpt"),
                  "command": ["-m", "trainwarden.runtime.examples.gpt", "--batch", "12", "--micro-batch-size", "2",
                              "--steps", "1000000", "--ckpt-every", "10"]}
        spec.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items()))
        out = self.cli("submit", str(spec))
        if out.returncode != 0:
            raise RuntimeError(out.stderr)

    def close(self) -> None:
        for path in self.dir.glob("*/daemon/launchers/*.json"):  # launchers live in sessions of their own
            try:
                os.kill(json.loads(path.read_text())["pid"], signal.SIGTERM)
            except (OSError, ValueError, KeyError):
                pass
        time.sleep(3)
        self.procs.close()
        for path in self.dir.glob("*/daemon/launchers/*.json"):
            try:
                os.kill(json.loads(path.read_text())["pid"], signal.SIGKILL)
            except (OSError, ValueError, KeyError):
                pass
        self.etcd.stop()


def _median_step(c: Cluster, job: str, since: float, until: float) -> float:
    times = [s for t, k, _, s in _story(c.job_log(job)) if k == "step" and since <= t <= until]
    return statistics.median(times) if times else float("nan")


def agent_kill(workdir: Path, window: float) -> dict:
    c = Cluster(workdir)
    try:
        c.start("n0")
        c.submit("ak", "1", 2)
        wait_for(lambda: len([e for e in _story(c.job_log("ak")) if e[1] == "step"]) >= 20, 180, what="training")
        a0 = time.time()
        time.sleep(window)
        alive = _median_step(c, "ak", a0, time.time())
        c.procs.kill(c.daemons["n0"])
        c.daemons["n0"].wait(10)
        d0 = time.time()
        time.sleep(window)
        dead = _median_step(c, "ak", d0, time.time())
        c.start("n0")
        r0 = time.time()
        time.sleep(window)
        adopted = _median_step(c, "ak", r0, time.time())
        readopted = "adopted its running launcher" in (workdir / "n0" / "daemon.log").read_text()
        return {"scenario": "agent-kill", "alive_ms": round(alive * 1e3, 1), "dead_ms": round(dead * 1e3, 1),
                "adopted_ms": round(adopted * 1e3, 1), "dead_ratio": round(dead / alive, 3),
                "adopted_ratio": round(adopted / alive, 3), "readopted": readopted}
    finally:
        c.close()


def drain(workdir: Path) -> dict:
    c = Cluster(workdir)
    try:
        for node in ("n0", "n1", "n2"):
            c.start(node)
        c.submit("dr", "2:3", 1)
        wait_for(lambda: c.nodes_of("dr") == ["n0", "n1", "n2"], 180, what="three nodes")
        base = max([n for _, k, n, _ in _story(c.job_log("dr")) if k == "step"] or [0])
        wait_for(lambda: max([n for _, k, n, _ in _story(c.job_log("dr")) if k == "step"] or [0]) >= base + 15, 240,
                 what="training on three nodes")
        t0 = time.time()
        out = c.cli("drain", "n2")
        if out.returncode != 0:
            raise RuntimeError(out.stderr)
        wait_for(lambda: "node n2 left job dr after the checkpoint of step" in c.job_log("dr"), 120, what="n2 to leave")
        at = int(re.search(r"n2 left job dr after the checkpoint of step (\d+)", c.job_log("dr")).group(1))
        def trained_after_resume() -> bool:
            story = _story(c.job_log("dr"))
            resumed = [t for t, k, n, _ in story if k == "resumed" and n == at and t > t0]
            return bool(resumed) and any(k == "step" and t > min(resumed) for t, k, _, _ in story)

        wait_for(trained_after_resume, 180, what="a step in the two-node world")
        story = _story(c.job_log("dr"))
        resumed_at = min(t for t, k, n, _ in story if k == "resumed" and n == at and t > t0)
        first = min(t for t, k, n, _ in story if k == "step" and t > resumed_at)
        lost = sorted({n for t, k, n, _ in story if k == "step" and t < resumed_at and n > at})
        return {"scenario": "drain", "checkpoint_step": at, "training_again_s": round(first - t0, 1),
                "lost": len(lost)}
    finally:
        c.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--window", type=float, default=20.0, help="seconds of steps per agent-kill window")
    p.add_argument("--only", default=",".join(SCENARIOS))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows = []
    for scenario in [s for s in args.only.split(",") if s]:
        if scenario not in SCENARIOS:
            p.error(f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}")
        for i in range(args.runs):
            with tempfile.TemporaryDirectory(prefix=f"bench-daemon-{scenario}-") as tmp:
                print(f"[{scenario} run {i + 1}/{args.runs}] ...", file=sys.stderr, flush=True)
                row = agent_kill(Path(tmp), args.window) if scenario == "agent-kill" else drain(Path(tmp))
                print(f"[{scenario} run {i + 1}/{args.runs}] {row}", file=sys.stderr, flush=True)
                rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for row in rows:
            print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: node loss on the multi-host test bed, trainwarden vs plain torchrun, same job and fault.

    python tests/bench/bench_node_loss.py [--runs 1] [--bound 120] [--only tw-kill,...] [--json]

Three simulated nodes of two CPU ranks each (tests/testbed.py, root needed) train the reference GPT with
tensor parallelism 2 inside a node and data parallelism across nodes (``--dp`` left to the world), a
checkpoint every 5 steps on storage the nodes share. When rank 0 has logged step 12, node n2 is killed
(SIGKILL of everything in it: a power loss) or partitioned (its link down: processes alive, network gone).
Measured from the fault, on the surviving nodes:

* detect: the launcher on a survivor starts a new rendezvous (its workers failed, or were aborted);
* rdzv: the new round is complete (``Rendezvous complete``);
* restore: rank 0 restored the checkpoint ("resumed from checkpoint step");
* step: rank 0 completed its first step in the smaller world: the recovery time;
* lost: steps rank 0 had logged before the restore that the smaller world computes again (from the disk's
  checkpoint, or from the memory snapshots the survivors hold, the lost node's as copies: ``source``).

Scenarios: ``tw-kill`` and ``tw-partition`` run `trainwarden run` on every node against a 3-member etcd
cluster on hosts of their own; ``torchrun-kill`` and ``torchrun-partition`` run plain torchrun with its c10d
rendezvous, the store on a surviving node (n0), and ``torchrun-kill-store`` with the store on the node that
is lost (n2); all with the shared-store workaround (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) and the same
``--max-restarts``. A scenario that does not train again within ``--bound`` seconds is reported as such.

Hot spare (``tw-spare-kill``, issue 47): the same job with ``--nnodes 2:2 --spare-nodes 1``: n0 and n1 train, n2
(started once they have) waits as a spare; n1 is killed at step 12 and n2 takes its ranks, so the world stays at
four ranks. Beside ``tw-kill-warm`` (the shrink: three training nodes, n2 killed, two go on) it is the cost of
replacing a node rather than shrinking without it.

Growing back (``tw-grow``, ``torchrun-grow``): n2 is killed at step 12 as above; once the two survivors have
trained 15 steps in their smaller world, n2's launcher is started again. Measured from that start: ``step``,
rank 0's first step in the six-rank world, and ``lost``: steps computed before the restart into the larger
world and computed again after it (trainwarden checkpoints on request at an agreed step and holds there;
torchrun restarts at once from the latest periodic checkpoint).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))
from testbed import TestBed  # noqa: E402

RANK0_STEP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank 0\] [\w.]+: step (\d+) loss", re.M)
RANK0_RESUMED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank 0\] [\w.]+: resumed from "
                           r"(?:checkpoint|the memory)", re.M)
TORCH_LOG = re.compile(r"^I(\d{4}) (\d\d:\d\d:\d\d\.\d{6}) \d+ .*?\] \[default\] (Rendezvous'ing worker group|"
                       r"Rendezvous complete for workers)", re.M)
GPT = ["-m", "trainwarden.runtime.examples.gpt", "--tp", "2", "--batch", "12", "--ckpt-every", "5"]
SCENARIOS = ("tw-kill", "tw-partition", "torchrun-kill", "torchrun-kill-store", "torchrun-partition", "tw-grow",
             "torchrun-grow", "tw-kill-warm", "tw-partition-warm", "tw-spare-kill")
"""``-warm``: warm workers, the default (the survivors' restarted workers fork with torch imported); the
others run ``trainwarden run --cold-workers``."""
SPARE_WARM_S = 30.0
"""``tw-spare-kill``: the spare runs this long before the kill, time for its zygote's imports (torch and the
script's), as a spare started with the job has."""
RANK0_RESUMED_AT = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank 0\] [\w.]+: resumed from "
                              r"(?:checkpoint step|the memory snapshots? of step) (\d+)", re.M)


def _stamp(text: str) -> float:
    return dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _torch_stamp(mmdd: str, hms: str) -> float:
    year = dt.date.today().year
    return dt.datetime.strptime(f"{year}{mmdd} {hms}", "%Y%m%d %H:%M:%S.%f").timestamp()


def _command(scenario: str, bed: TestBed, node: str, ckpt: Path, state: Path) -> tuple[list[str], dict]:
    env = dict(os.environ, TRAINWARDEN_STATE_HOME=str(state / node), LOGLEVEL="INFO", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1")
    job = GPT + ["--steps", "400", "--ckpt-dir", str(ckpt)]
    if scenario == "tw-spare-kill":  # warm workers, as tw-kill-warm
        return [sys.executable, "-m", "trainwarden.agent.cli", "run", "--metrics-port", "0", "--nnodes", "2:2",
                "--spare-nodes", "1", "--nproc-per-node", "2", "--node", node, "--max-restarts", "3", "--job", "bench",
                "--etcd", bed.etcd_endpoints, "--", *job], env
    if scenario.startswith("tw-"):
        return [sys.executable, "-m", "trainwarden.agent.cli", "run", "--metrics-port", "0", "--nnodes", "2:3",
                "--nproc-per-node", "2", "--node", node, "--max-restarts", "3", "--job", "bench",
                "--etcd", bed.etcd_endpoints, *(["--warm-workers"] if scenario.endswith("-warm") else ["--cold-workers"]),
                "--", *job], env
    store = "n2" if scenario == "torchrun-kill-store" else "n0"
    env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", GLOO_SOCKET_IFNAME="eth0")
    env.pop("TRAINWARDEN_AGENT_SOCKET", None)
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{bed.address(store)}:29400", "--rdzv-id", "bench",
            "--max-restarts", "3", "--monitor-interval", "1", "--local-addr", bed.address(node),
            # every simulated node has the machine's host name: say which one hosts the store
            "--rdzv-conf", f"is_host={'true' if node == store else 'false'}", *job], env


def _texts(logs: dict[str, Path], nodes) -> str:
    return "".join(logs[n].read_text(errors="replace") for n in nodes if logs[n].exists())


def _survivor_logs(logs: dict[str, Path], state: Path, survivors=("n0", "n1")) -> str:
    """The survivors' output and, for `trainwarden run`, torchrun's own log lines kept in the job's log."""
    extra = [p for n in survivors for p in (state / n).glob("jobs/*/logs/run.log")]
    return _texts(logs, survivors) + "".join(p.read_text(errors="replace") for p in extra)


def _rank0_story(text: str) -> list[tuple[float, str, int]]:
    """Rank 0's steps and resumes, (time, "step" or "resumed", step), in time order, from every log."""
    events = [(_stamp(m.group(1)), "step", int(m.group(2))) for m in RANK0_STEP.finditer(text)]
    events += [(_stamp(m.group(1)), "resumed", int(m.group(2))) for m in RANK0_RESUMED_AT.finditer(text)]
    return sorted(events)


def run_grow(scenario: str, bound: float, workdir: Path) -> dict:
    """n2 killed at step 12, started again 15 steps later; how the job takes it back (module docstring)."""
    ckpt, state = workdir / "ckpt", workdir / "state"
    tw = scenario.startswith("tw-")
    with TestBed(nodes=3, etcd_members=3 if tw else 0, workdir=workdir / "bed") as bed:
        logs = {n: workdir / f"{n}.log" for n in ("n0", "n1", "n2")}
        for node in ("n0", "n1", "n2"):
            cmd, env = _command(scenario, bed, node, ckpt, state)
            bed.spawn(node, cmd, log=logs[node], env=env)

        def story():
            return _rank0_story(_texts(logs, logs))

        def wait(what, predicate, seconds):
            deadline = time.monotonic() + seconds
            while not predicate():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{scenario}: {what} within {seconds:.0f} s; see {workdir}")
                time.sleep(0.3)

        wait("no step 12", lambda: max((n for _, k, n in story() if k == "step"), default=0) >= 12, 300)
        killed = time.time()
        bed.kill("n2")
        logs["n2"].rename(workdir / "n2.killed.log")
        logs["killed"] = workdir / "n2.killed.log"
        wait("no resume in the smaller world", lambda: any(k == "resumed" and t > killed for t, k, _ in story()), bound)
        shrunk_at = max(t for t, k, _ in story() if k == "resumed")
        wait("no step in the smaller world", lambda: any(k == "step" and t > shrunk_at for t, k, _ in story()), 60)
        base = min(n for t, k, n in story() if k == "step" and t > shrunk_at)
        wait("the survivors did not train 15 steps", lambda: max(n for _, k, n in story() if k == "step") >= base + 15, bound)
        cmd, env = _command(scenario, bed, "n2", ckpt, state)
        started = time.time()
        bed.spawn("n2", cmd, log=logs["n2"], env=env)
        result = {"scenario": scenario, "fault": "grow"}
        try:
            wait("no resume in the larger world", lambda: any(k == "resumed" and t > started for t, k, _ in story()),
                 bound)
            grown = min(t for t, k, _ in story() if k == "resumed" and t > started)
            wait("no step in the larger world", lambda: any(k == "step" and t > grown for t, k, _ in story()), 60)
        except RuntimeError as exc:
            return {**result, "step_s": None, "note": str(exc).split(";")[0]}
        events = story()
        resumed = next(n for t, k, n in events if k == "resumed" and t == grown)
        before = {n for t, k, n in events if k == "step" and shrunk_at < t < grown}
        return {**result, "restore_s": round(grown - started, 1),
                "step_s": round(min(t for t, k, _ in events if k == "step" and t > grown) - started, 1),
                "resumed_from": resumed, "lost": len([n for n in before if n > resumed])}


def run_scenario(scenario: str, bound: float, workdir: Path) -> dict:
    try:
        return (run_grow if scenario.endswith("-grow") else _run_fault)(scenario, bound, workdir)
    finally:
        _sweep_killed_runs()


def _sweep_killed_runs() -> None:
    """What the bed's runs left on this machine when it tore them down (their temp directories and memory
    snapshots in /dev/shm): only directories whose owner process is gone are removed."""
    from trainwarden.agent.launch.run import sweep_killed_runs

    sweep_killed_runs()


def _run_fault(scenario: str, bound: float, workdir: Path) -> dict:
    fault = "partition" if "partition" in scenario else "kill"
    ckpt, state = workdir / "ckpt", workdir / "state"
    with TestBed(nodes=3, etcd_members=3 if scenario.startswith("tw-") else 0, workdir=workdir / "bed") as bed:
        logs = {n: workdir / f"{n}.log" for n in ("n0", "n1", "n2")}
        spare = scenario == "tw-spare-kill"  # n0 and n1 train, n2 waits as their spare: n1 is lost
        victim, survivors = ("n1", ("n0", "n2")) if spare else ("n2", ("n0", "n1"))
        deadline = time.monotonic() + 300

        def reached(step: int) -> bool:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{scenario}: the job did not reach step {step} in 300 s; see {workdir}")
            return max((int(m.group(2)) for m in RANK0_STEP.finditer(_texts(logs, logs))), default=0) >= step

        for node in ("n0", "n1", "n2"):
            while spare and node == "n2" and not reached(1):  # the first round is n0 and n1's
                time.sleep(0.2)
            cmd, env = _command(scenario, bed, node, ckpt, state)
            bed.spawn(node, cmd, log=logs[node], env=env)
        spare_started = time.monotonic()
        # a spare waits in the rendezvous, its zygote's imports done (SPARE_WARM_S: a spare is started long before)
        while not reached(12) or (spare and ("waits in round" not in _texts(logs, ("n2",))
                                             or time.monotonic() - spare_started < SPARE_WARM_S)):
            time.sleep(0.2)
        t0 = time.time()
        (bed.partition if fault == "partition" else bed.kill)(victim)
        result = {"scenario": scenario, "fault": fault}
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            text = _survivor_logs(logs, state, survivors)
            resumed = [_stamp(m.group(1)) for m in RANK0_RESUMED.finditer(text) if _stamp(m.group(1)) > t0]
            steps = [_stamp(m.group(1)) for m in RANK0_STEP.finditer(text)]
            if resumed and [s for s in steps if s > min(resumed)]:
                torch_events = [(_torch_stamp(*m.groups()[:2]), m.group(3)) for m in TORCH_LOG.finditer(text)]
                after = [(t, what) for t, what in torch_events if t > t0]
                detect = min((t for t, w in after if w.startswith("Rendezvous'ing")), default=None)
                rdzv = min((t for t, w in after if w.startswith("Rendezvous complete")), default=None)
                at = [int(m.group(2)) for m in RANK0_RESUMED_AT.finditer(text) if _stamp(m.group(1)) == min(resumed)]
                reached = max(int(m.group(2)) for m in RANK0_STEP.finditer(_texts(logs, logs))
                              if _stamp(m.group(1)) < min(resumed))
                result.update(
                    detect_s=round(detect - t0, 1) if detect else None, rdzv_s=round(rdzv - t0, 1) if rdzv else None,
                    restore_s=round(min(resumed) - t0, 1),
                    step_s=round(min(s for s in steps if s > min(resumed)) - t0, 1),
                    # steps rank 0 had logged (any node) that the survivors compute again
                    lost=reached - at[0] if at else None, source="memory" if "resumed from the memory snapshots of "
                    f"step {at[0] if at else -1} taken" in text else "disk")
                return result
            time.sleep(0.5)
        result["step_s"] = None
        result["note"] = f"not training again {bound:.0f} s after the fault"
        return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=1, help="runs of each scenario (medians printed)")
    p.add_argument("--bound", type=float, default=120.0, help="seconds to wait for training after the fault")
    p.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios")
    p.add_argument("--json", action="store_true")
    p.add_argument("--keep", metavar="DIR", help="keep each run's logs under DIR (default: a temporary directory)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the test bed tears itself down
    reason = TestBed.unavailable()
    if reason:
        print(f"bench_node_loss: {reason}", file=sys.stderr)
        return 2
    scenarios = [s for s in args.only.split(",") if s]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    rows = []
    for scenario in scenarios:
        for i in range(args.runs):
            with tempfile.TemporaryDirectory(prefix=f"nodeloss-{scenario}-", dir=args.keep) as tmp:
                print(f"[{scenario} run {i + 1}/{args.runs}] ...", file=sys.stderr, flush=True)
                row = run_scenario(scenario, args.bound, Path(tmp))
                print(f"[{scenario} run {i + 1}/{args.runs}] {row}", file=sys.stderr, flush=True)
                rows.append(row)
                if args.keep:  # TemporaryDirectory would delete it
                    kept = Path(args.keep) / f"{scenario}-{i + 1}"
                    Path(tmp).rename(kept)
                    Path(tmp).mkdir()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'scenario':22} {'runs':>4} {'detect':>7} {'rdzv':>6} {'restore':>8} {'step':>6} {'lost':>5}   (s after the "
          "fault or, growing, after the node's start; medians)")
    for scenario in scenarios:
        mine = [r for r in rows if r["scenario"] == scenario]

        def med(key):
            values = [r[key] for r in mine if r.get(key) is not None]
            return f"{statistics.median(values):.1f}" if len(values) == len(mine) else "-"
        line = f"{scenario:22} {len(mine):>4} {med('detect_s'):>7} {med('rdzv_s'):>6} {med('restore_s'):>8} " \
               f"{med('step_s'):>6} {med('lost'):>5}"
        notes = {r["note"] for r in mine if r.get("note")}
        print(line + (f"   {'; '.join(notes)}" if notes else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

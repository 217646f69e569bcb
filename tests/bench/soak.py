"""Soak (issue 45, item 1): the reference job on the multi-node bed under mixed random faults, with invariants.

    sudo python tests/bench/soak.py --minutes 8 --seed 1 [--kinds crash,hang,...] [--keep DIR] [--json]
    sudo python tests/bench/soak.py --minutes 60 --step-s 1.5 --pad-s 1.0 --seed 46   # the hour, paced

Two simulated nodes of four CPU ranks (tests/testbed.py) run `trainwarden run --nnodes 1:2` against a 3-member
etcd on hosts of their own: the reference GPT 3D-parallel (tp 2 x pp 2 inside a node, data parallelism across),
memory snapshots after every step (the default) and a disk checkpoint every 10 steps on storage both nodes share.
First the same job runs fault-free on a fresh bed (with the draw's NaN faults only: a NaN step's update is skipped
by design, so the fault-free run skips it too); then the soak run. Steps: ``--minutes`` x 60 / ``--step-s``.

Faults are drawn by ``--seed`` (tests/bench/_soak_plan.py): one every 45-90 s of training, converted to steps with
``--step-s`` (on a machine whose steps are faster than that, ``--pad-s`` makes each step of the soak run sleep the
difference, a stand-in for accelerator compute: faults then come as far apart in time as planned); the soak injects
the next only when the job has recovered from the last (rank 0 logged a step after
the fault's recovery). Kinds: rank crash (SIGKILL of the worker), SIGSTOP of a worker, a hang outside a collective,
a slow rank (x3 for 30 steps), a NaN loss, node n1 killed and started again, n1 partitioned (held until its
node_lost and fence are recorded, at most 60 s) and healed, n1's agent (its `trainwarden run`) SIGKILLed and
started again, one etcd member killed and restarted, the newest committed
checkpoint truncated or a byte flipped followed by a power loss of both nodes (a restore from disk must pass it
over), n1's link degraded (``_soak_plan.DEGRADED_RATE`` both ways) until a comm_regression is recorded, etcd's quorum
lost (two of three members stopped for 20 s), the checkpoint directory full (its own tmpfs filled until a save fails,
then freed). With ``--daemon`` (the daemon-run variant) a node daemon runs on each node and the job is submitted to
them: n1's daemon SIGKILLed and started again after 10 s (its launcher must be adopted, the job train on meanwhile)
joins the catalogue, and n1's killed launcher or its power loss is the daemon's to start again, not the soak's.

Invariants, each printed as ``invariant NAME: ok|FAILED (detail)``: the job finishes; its final loss equals the
fault-free run's (bit-equal at the logged precision unless the world changed size; else bit-equal up to the first
shrink and the last 100 steps' mean within ``_soak_plan.LOSS_TAIL_TOLERANCE``), and every step trained again after a
restore equal to its first run; no committed checkpoint lost or silently replaced, no step 1 after a commit; every fault exactly its
incident(s) naming its rank or node, nothing else an incident but the consequences ``_soak_plan.CONSEQUENCES``
accepts and says why (``restart`` records are actions, not counted); n0's goodput ledger against the step log within
2 % on what every rank measures alike (``_soak_plan.in_round_seconds``); the agents' and launchers' RSS, threads and
fds within 10 % of their level after the first restart (threads and fds: or 3 more, ``_soak_plan.ETCD_FAILOVER_ALLOWANCE``); nothing left behind (processes, namespaces, TMPDIR and
shared-memory directories, the bootstrap keys of the job's finished rendezvous rounds in etcd). Ends with ``soak: F faults of K kinds in M min; invariants broken: B``; exit 0 only when B is 0.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from _soak_plan import (CATALOGUE, DAEMON_ONLY, DEGRADED_RATE, LEFT_OUT, QUORUM_LOST_S, SLOW_STEPS, Verdict,  # noqa: E402
                        checkpoints_kept, draw, faults_env, first_shrink, flags_over_the_limit, flat, ledger_agrees,
                        loss_matches,
                        match_incidents, no_fresh_start)
from _soak_job import GROW_BOUND_S, JOB, NODES, SHRANK, Job, Sampler, corrupt, fill  # noqa: E402
from testbed import TestBed  # noqa: E402

DAEMON_AWAY_S = 10.0
"""How long a SIGKILLed daemon stays away before it is started again (a systemd restart takes about as long)."""

PARTITION_HOLD_S = 60.0
"""Longest a partition is held for its node_lost and fenced incidents (the membership lease is 10 s)."""


class Soak:
    def __init__(self, job: Job, deadline: float) -> None:
        self.job, self.deadline = job, deadline

    def wait(self, what: str, check, timeout: float = 240.0):
        end = min(self.deadline, time.monotonic() + timeout)
        while time.monotonic() < end:
            value = check()
            if value:
                return value
            if not any(p.poll() is None for p in self.job.runs.values()):
                raise RuntimeError(f"every node's run exited while waiting for {what}")
            time.sleep(0.5)
        raise TimeoutError(f"no {what} within {timeout:.0f} s")

    def inject(self, fault) -> None:
        job, bed = self.job, self.job.bed
        kind = CATALOGUE[fault.kind]
        if kind.inside:
            self.wait(f"step {fault.step}", lambda: job.last_step() >= fault.step, 600)
            fault.at = next(t for t, s, _ in job.steps_logged() if s == fault.step - 1 or s >= fault.step)
            if fault.kind == "slow":
                self.wait("the slow window's end", lambda: job.last_step() >= fault.step + SLOW_STEPS + 3, 600)
                fault.recovered_at = time.time()
            elif fault.kind == "nan":
                self.wait("steps after the NaN", lambda: job.last_step() >= fault.step + 3)
                fault.recovered_at = time.time()
            else:
                fault.recovered_at = self.wait("the resume after the hang", lambda: job.resumed_after(fault.at))
            fault.notes.append(f"recovered after {fault.recovered_at - fault.at:.1f} s")  # else its line is empty
            return
        self.wait(f"step {fault.step}", lambda: job.last_step() >= fault.step, 600)
        if fault.kind in ("crash", "sigstop"):
            found = self.wait(f"rank {fault.rank}'s worker", lambda: job.worker_pid(fault.rank), 60)
            fault.at = time.time()
            os.kill(found[0], signal.SIGKILL if fault.kind == "crash" else signal.SIGSTOP)
            fault.notes.append(f"pid {found[0]} on {found[1]}")
            fault.recovered_at = self.wait("the resume", lambda: job.resumed_after(fault.at))
        elif fault.kind in ("node_kill", "partition", "agent_kill"):
            fault.at = time.time()
            if fault.kind == "node_kill":
                bed.kill(fault.node)
            elif fault.kind == "partition":
                bed.partition(fault.node)
            else:  # its `trainwarden run`: the one the soak started, or the one the node's daemon runs
                pid = job.launcher(fault.node) if job.daemon else job.runs[fault.node].pid
                if pid is None:
                    raise RuntimeError(f"{fault.node}'s daemon records no running launcher of the job")
                os.kill(pid, signal.SIGKILL)
                fault.notes.append(f"pid {pid}")
            survivors = self.wait("the survivors' resume", lambda: job.resumed_after(fault.at))
            fault.notes.append(f"survivors trained again after {survivors - fault.at:.1f} s")
            if fault.kind == "partition":
                # held until the node is lost by the product's own measure (its membership lease ended: n0's
                # node_lost, n1's fence): a partition shorter than the lease is a hang without a culprit, and in
                # the hour of session 33, with 0.5 s steps, the survivors trained again 5 s in, before the lease
                # (10 s) could end, so neither incident came
                try:
                    self.wait("the partitioned node's loss and fence", lambda: self._incident(
                        "node_lost", fault.at) and self._incident("fenced", fault.at), PARTITION_HOLD_S)
                except TimeoutError:
                    pass  # the judge says which incident is missing
                fault.notes.append(f"healed after {time.time() - fault.at:.1f} s")
            # a daemon starts a killed launcher again at once (in session 36's first run, 30 ms after the kill,
            # before the survivors had resumed): the node may be back before the survivors resumed without it
            back = fault.at if fault.kind == "agent_kill" and job.daemon else time.time()
            if fault.kind == "partition":
                bed.heal(fault.node)
            elif fault.kind == "node_kill" or not job.daemon:  # a killed launcher the daemon starts again itself
                job.runs[fault.node].wait(30) if job.runs[fault.node].poll() is None else None
                job.start(fault.node)
            try:
                fault.recovered_at = self.wait("the grow-back", lambda: job.full_after(back), GROW_BOUND_S)
            except TimeoutError:
                fault.failed = f"the job did not grow back to both nodes within {GROW_BOUND_S:.0f} s"
                fault.notes.append(fault.failed)
                fault.recovered_at = time.time()
        elif fault.kind == "daemon_kill":
            self._daemon_kill(fault)
        elif fault.kind == "etcd_member":
            fault.at = time.time()
            bed.kill(fault.variant)
            time.sleep(10)
            bed.start_etcd_member(fault.variant)
            self.wait(f"{fault.variant} healthy", lambda: bed.etcd_healthy(fault.variant), 60)
            later = job.last_step() + 3
            self.wait("steps after the restart", lambda: job.last_step() >= later)
            fault.recovered_at = time.time()
        elif fault.kind == "ckpt_corrupt":
            since = time.time()
            commit = self.wait("a commit", lambda: [c for c in job.commits() if c[0] > since])[0]
            fault.at = time.time()
            fault.notes.append(f"step {commit[1]}: {corrupt(Path(commit[2]), fault.variant)}")
            for node in NODES:
                bed.kill(node)
            back = time.time()
            for node in NODES:
                job.start(node)
            fault.recovered_at = self.wait("the restore", lambda: job.resumed_after(back), 300)
            try:
                self.wait("both nodes in the round", lambda: job.full_after(back), GROW_BOUND_S)
            except TimeoutError:
                fault.failed = f"the job did not train on both nodes within {GROW_BOUND_S:.0f} s of their restart"
                fault.notes.append(fault.failed)
        elif fault.kind == "degrade":
            self._degrade(fault)
        elif fault.kind == "quorum":
            members = fault.variant.split(",")
            fault.at = time.time()
            for member in members:
                bed.kill(member)
            time.sleep(QUORUM_LOST_S)
            for member in members:
                bed.start_etcd_member(member)
            for member in members:
                self.wait(f"{member} healthy", lambda: bed.etcd_healthy(member), 60)
            fault.notes.append(f"{fault.variant} down for {time.time() - fault.at:.1f} s")
            later = job.last_step() + 3
            self.wait("steps after the quorum's return", lambda: job.last_step() >= later)
            fault.recovered_at = time.time()
        elif fault.kind == "enospc":
            fault.at = time.time()
            filler, written = fill(job.ckpt)
            try:
                failed = self.wait("a failed save", lambda: self._incident("checkpoint_failed", fault.at), 180)
                fault.notes.append(f"filled with {written >> 10} KiB; the save of step "
                                   f"{failed['evidence'].get('step')} failed")
            finally:
                filler.unlink()
            freed = time.time()
            commit = self.wait("a commit after the space returned",
                               lambda: [c for c in job.commits() if c[0] > freed], 180)[0]
            fault.notes.append(f"step {commit[1]} committed {commit[0] - freed:.1f} s after the space returned")
            fault.recovered_at = time.time()
        fault.notes.append(f"recovered after {fault.recovered_at - fault.at:.1f} s")

    def _incident(self, kind: str, since: float) -> dict | None:
        return next((i for i in _incidents(self.job.work) if i["kind"] == kind and i["detected_at"] >= since), None)

    def _daemon_kill(self, fault) -> None:
        """n1's daemon SIGKILLed and, after ``DAEMON_AWAY_S``, started again: the job must train on meanwhile and
        the new daemon adopt the same launcher (not start a second one, not take the job for finished)."""
        job = self.job
        launcher = self.wait(f"{fault.node}'s launcher", lambda: job.launcher(fault.node), 60)
        daemon = job.runs[fault.node]
        fault.at = time.time()
        os.kill(daemon.pid, signal.SIGKILL)
        daemon.wait(10)
        at_kill = job.last_step()
        time.sleep(DAEMON_AWAY_S)
        fault.notes.append(f"{job.last_step() - at_kill} steps trained in the {DAEMON_AWAY_S:.0f} s without the daemon")
        job.start(fault.node)
        line = f"adopted its running launcher (pid {launcher})"
        try:
            self.wait("the launcher's adoption", lambda: line in job.daemon_text(fault.node), 60)
            fault.notes.append(f"launcher pid {launcher} adopted {time.time() - fault.at:.1f} s after the kill")
        except TimeoutError:
            fault.failed = f"the new daemon did not adopt launcher pid {launcher} within 60 s"
            fault.notes.append(fault.failed)
        if job.launcher(fault.node) != launcher:
            fault.failed = f"{fault.node} runs launcher pid {job.launcher(fault.node)}, not pid {launcher}"
            fault.notes.append(fault.failed)
        later = job.last_step() + 3
        self.wait("steps after the daemon's return", lambda: job.last_step() >= later)
        fault.recovered_at = time.time()

    def _degrade(self, fault) -> None:
        """n1's link slowed both ways until a comm_regression is recorded (at most 90 s), then restored; recovered
        when that incident is resolved (the steps back near their pace) or, without one, 5 steps later."""
        job, bed = self.job, self.job.bed
        fault.at = time.time()
        bed.degrade(fault.node, DEGRADED_RATE)
        try:
            seen = self.wait("a comm_regression incident", lambda: self._incident("comm_regression", fault.at), 90)
            fault.notes.append(f"comm_regression on {seen['node']} {seen['detected_at'] - fault.at:.1f} s after")
        except TimeoutError:
            seen = None
            fault.notes.append("no comm_regression within 90 s")
        finally:
            bed.restore_link(fault.node)
        restored = time.time()
        if seen is not None:
            try:
                self.wait("the comm_regression's end", lambda: all(
                    i["state"] in ("resolved", "failed") for i in _incidents(job.work)
                    if i["kind"] == "comm_regression" and i["detected_at"] >= fault.at), 180)
            except TimeoutError:
                fault.notes.append("its comm_regression still open 180 s after the link was restored")
        later = job.last_step() + 5
        self.wait("steps after the link's restore", lambda: job.last_step() >= later)
        fault.notes.append(f"link restored after {restored - fault.at:.1f} s")
        fault.recovered_at = time.time()


def _incidents(work: Path) -> list[dict]:
    found = []
    for path in (work / "state").glob(f"*/jobs/{JOB}/incidents/*.json"):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return found


def run_job(work: Path, steps: int, faults: list, spec: str, shm: Path, budget_s: float, pad_s: float = 0.0,
            daemon: bool = False) -> dict:
    """One run of the job on a fresh bed; with ``faults`` the soak injects them; with ``daemon``, a node daemon per
    node runs it, submitted. What was seen, for the verdicts."""
    out: dict = {"work": str(work)}
    small_disk = any(f.kind == "enospc" for f in faults)
    with TestBed(nodes=2, etcd_members=3, workdir=work / "bed") as bed, _checkpoint_disk(work / "ckpt", small_disk):
        job = Job(bed, work, steps, spec, shm, pad_s, daemon=daemon)
        launched = time.time()
        for node in NODES:
            job.start(node)
        sampler = Sampler(job)
        sampler.start()
        soak = Soak(job, time.monotonic() + budget_s)
        try:
            if daemon:
                job.submit()
            for fault in faults:
                print(f"[{time.time() - launched:6.0f} s] {fault.describe()} ...", flush=True)
                soak.inject(fault)
                print(f"[{time.time() - launched:6.0f} s]   {'; '.join(fault.notes)}", flush=True)
            soak.wait(f"step {steps}", lambda: job.last_step() >= steps, budget_s)
            out["exit"] = job.wait_exit(120)
        except Exception as exc:  # SIGTERM (Stopped), a wait that timed out, or the soak's own bug: judge what was seen
            out["error"] = f"{type(exc).__name__}: {exc}"
            print(f"soak stopped: {exc}", flush=True)
        finally:
            sampler.done.set()
            sampler.join(10)
        out.update(launched=launched, steps=job.steps_logged(), commits=job.commits(), text_shrank=bool(
            SHRANK.search(job.text())), samples=sampler.samples, incidents=_incidents(work), logs=[str(p) for p in job.logs])
        out["present"] = {str(p) for p in job.ckpt.glob("*") if p.is_dir()}
        out["flags_over_the_limit"] = [flag for log in job.logs if log.exists() for flag in flags_over_the_limit(
            job.log_node[log], log.read_text(errors="replace"), JOB)]
        out.update(runs=job.step_runs(), round_starts=job.round_starts(), worlds=job.worlds())
        ledger = work / "state" / "n0" / "jobs" / JOB / "history" / "goodput.json"
        out["ledger"] = json.loads(ledger.read_text()) if ledger.exists() else None
        out["leftovers"] = _finished_rounds_in_etcd(bed)
    out["leftovers"] += bed.leftovers()
    return out


def _finished_rounds_in_etcd(bed: TestBed) -> list[str]:
    """The job's rendezvous rounds whose bootstrap keys are still in etcd at its end, but the last one's (its
    record: the job ended in it). Asked from inside e0's host; an etcd that does not answer says so."""
    ctl = str(Path(sys.executable).parent / "etcdctl")
    prefix = f"/trainwarden/v1/rdzv/{JOB}/store/native/"
    try:
        got = bed.run("e0", [ctl, "--endpoints", bed.etcd_endpoints, "--dial-timeout", "2s", "--command-timeout",
                             "5s", "get", "--prefix", "--keys-only", prefix], timeout=15)
    except subprocess.TimeoutExpired:
        return ["etcd: no answer when asked for the job's rendezvous keys"]
    if got.returncode != 0:
        return [f"etcd: the job's rendezvous keys could not be read ({got.stderr.strip()[:200]})"]
    rounds = sorted({int(r) for r in (line[len(prefix):].split("/", 1)[0] for line in got.stdout.split()
                                      if line.startswith(prefix)) if r.isdigit()})
    return [f"etcd: bootstrap keys of finished round {r} ({prefix}{r}/)" for r in rounds[:-1]]


@contextlib.contextmanager
def _checkpoint_disk(path: Path, small: bool):
    """The checkpoints' own small tmpfs (``CKPT_DISK``) when the draw fills it (``enospc``), unmounted at the end."""
    path.mkdir(parents=True, exist_ok=True)
    if not small:
        yield
        return
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={CKPT_DISK},mode=0755", "tmpfs", str(path)], check=True)
    try:
        yield
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


CKPT_DISK = "96m"
"""The checkpoint tmpfs of an ``enospc`` draw: the 3 kept checkpoints (4 MiB each), a save in flight and whatever
restores set aside, with room to spare until the soak fills it."""


def _left_behind(work: Path, shm: Path, bed_leftovers: list[str]) -> Verdict:
    found = list(bed_leftovers)
    for p in psutil.process_iter(["pid", "cmdline"]):
        if str(work) in " ".join(p.info["cmdline"] or []) and p.pid != os.getpid():
            found.append(f"pid {p.pid}")
    for root in [*work.glob("*/tmp/*"), *shm.glob("*/*")]:
        found += [str(p) for p in root.iterdir()]
    return Verdict("nothing_left", not found, "; ".join(found[:8]) or "no process, namespace, temp or shm entry")


def verdicts(ref: dict, soak: dict, faults: list, keep: int, work: Path, shm: Path) -> list[Verdict]:
    out = []
    steps = soak["steps"]
    last = max((s for _, s, _ in steps), default=0)
    finished = "error" not in soak and all(c == 0 for c in soak.get("exit", {}).values())
    out.append(Verdict("finishes", finished, soak.get("error") or f"last step {last}, exit codes {soak.get('exit')}"))
    worlds = [tuple(w) for w in soak.get("worlds", [])]
    shrank_at = first_shrink([f.at for f in faults if f.at and CATALOGUE[f.kind].shrinks], worlds)
    if shrank_at is None and soak["text_shrank"]:
        shrank_at = 0.0
    out.append(loss_matches(steps if finished else [], ref["steps"], shrank_at=shrank_at, worlds=worlds))
    set_aside = {i["evidence"].get("step") for i in soak["incidents"] if i["kind"] == "checkpoint_set_aside"}
    out.append(checkpoints_kept(soak["commits"], soak["present"], keep, set_aside))
    story = [(t, "step", s) for t, s, _ in steps] + [(t, "commit", s) for t, s, _ in soak["commits"]]
    out.append(no_fresh_start(sorted(story)))
    # a straggler flagged past the per-hour incident limit is said in the log, not recorded: it counts as its incident
    out.append(match_incidents(faults, soak["incidents"] + soak.get("flags_over_the_limit", [])))
    late = [f"{f.describe()}: {f.failed}" for f in faults if getattr(f, "failed", None)]
    out.append(Verdict("recoveries", not late, "; ".join(late) or "every fault recovered, nodes back in the world"))
    out.append(ledger_agrees(soak["ledger"], soak["runs"], soak["round_starts"], soak["launched"]))
    first = min((f.recovered_at for f in faults if f.recovered_at and CATALOGUE[f.kind].restarts), default=None)
    # no fault that restarts (a soak of quorum losses only): each process's level is its first sample once settled
    out.append(flat(soak["samples"], first if first is not None else 0.0))
    out.append(_left_behind(work, shm, soak["leftovers"] + ref["leftovers"]))
    return out


class Stopped(RuntimeError):
    """SIGTERM (the heavy run's cap): the soak stops where it is, and still says what held."""


def _stop(*_) -> None:
    raise Stopped("stopped by SIGTERM before the job finished")


def _reference(args, work: Path, steps: int, faults: list, shm: Path) -> dict:
    """The fault-free run (with the draw's NaN faults): from ``--reference`` when it holds this job's, else run."""
    spec = faults_env(faults, only=("nan",))
    key = {"steps": steps, "faults": spec}
    saved = Path(args.reference) if args.reference else None
    if saved is not None and saved.exists():
        data = json.loads(saved.read_text())
        if data.get("key") == key:
            print(f"fault-free run: from {saved} ({data['when']})", flush=True)
            return {"work": str(work / "reference"), "steps": [tuple(s) for s in data["steps"]],
                    "leftovers": data["leftovers"]}
    ref = run_job(work / "reference", steps, [], spec, shm / "reference", budget_s=args.minutes * 60 * 2 + 300)
    if saved is not None:
        saved.write_text(json.dumps({"key": key, "when": dt.datetime.now().isoformat(timespec="seconds"),
                                     "steps": ref["steps"], "leftovers": ref["leftovers"]}))
    return ref


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--step-s", type=float, default=0.55, help="a step's seconds on the bed, to size the job and "
                   "convert the gaps (default 0.55, this machine's)")
    p.add_argument("--kinds", default=None, help=f"fault kinds to draw from (default all: "
                   f"{','.join(CATALOGUE)}; {', '.join(DAEMON_ONLY)} only with --daemon)")
    p.add_argument("--daemon", action="store_true", help="the daemon-run variant: a node daemon (`trainwarden "
                   "agent`) on each node, the job submitted to them; adds the daemon's SIGKILL to the catalogue, and "
                   "a killed launcher or a node's power loss is the daemon's to start again")
    p.add_argument("--pad-s", type=float, default=0.0, help="seconds each step of the soak run sleeps, a stand-in "
                   "for accelerator compute (the job's --step-pad-s), so its steps take the --step-s the plan assumes "
                   "on a machine faster than that (default 0; the fault-free run is not padded: the losses are the "
                   "same)")
    p.add_argument("--gap-s", default="45,90", help="seconds of training between faults, drawn uniformly in "
                   "MIN,MAX (default 45,90)")
    p.add_argument("--budget-s", type=float, default=None, help="stop the soak run after this many seconds and "
                   "judge what was seen (default: 3 x --minutes + 5 min)")
    p.add_argument("--reference", metavar="FILE", help="the fault-free run's result: read from FILE when it holds "
                   "this job's (same steps, same NaN faults), else run and written there; with --reference-only, "
                   "stop after it (a run of each under the 12-minute cap on a loaded machine)")
    p.add_argument("--reference-only", action="store_true")
    p.add_argument("--keep", metavar="DIR", help="keep the runs' logs and state under DIR")
    p.add_argument("--json", action="store_true", help="also print the faults and verdicts as JSON")
    args = p.parse_args(argv)
    reason = TestBed.unavailable()
    if reason:
        p.error(reason)
    signal.signal(signal.SIGTERM, _stop)  # stop where it is, tear the bed down and judge what was seen
    steps = int(args.minutes * 60 / args.step_s)
    gap = tuple(float(x) for x in args.gap_s.split(","))
    kinds = args.kinds.split(",") if args.kinds else [k for k in CATALOGUE if args.daemon or k not in DAEMON_ONLY]
    if not args.daemon and set(kinds) & set(DAEMON_ONLY):
        p.error(f"--kinds {','.join(sorted(set(kinds) & set(DAEMON_ONLY)))} needs --daemon (a daemon to kill)")
    try:
        faults = draw(args.seed, steps=steps, step_s=args.step_s, kinds=kinds, gap_s=gap)
    except ValueError as exc:
        p.error(str(exc))
    print(f"soak: seed {args.seed}, {steps} steps, {len(faults)} faults drawn:\n  " +
          "\n  ".join(f.describe() for f in faults), flush=True)
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tw-soak-", dir=args.keep))
    shm = Path(tempfile.mkdtemp(prefix="tw-soak-", dir="/dev/shm"))
    started = time.monotonic()
    try:
        ref = _reference(args, work, steps, faults, shm)
        ref_s = time.monotonic() - started
        print(f"fault-free run: {ref_s:.0f} s, last step {max((s for _, s, _ in ref['steps']), default=0)}", flush=True)
        if args.reference_only:
            return 0
        soak = run_job(work / "soak", steps, faults, faults_env(faults), shm / "soak", daemon=args.daemon,
                       budget_s=args.budget_s or args.minutes * 60 * 3 + 300, pad_s=args.pad_s)
        results = verdicts(ref, soak, faults, 3, work, shm)
        if args.keep:  # what the invariants were judged from, to judge again (``_soak_plan``) without a rerun
            try:
                (work / "judged.json").write_text(json.dumps(soak, default=str))
            except (OSError, TypeError, ValueError) as exc:
                print(f"soak: could not keep what was judged ({exc}); the verdicts follow", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    for v in results:
        print(v.line())
    injected = [f for f in faults if f.at is not None]
    broken = sum(not v.ok for v in results)
    soak_min = (time.monotonic() - started - ref_s) / 60
    print("faults: " + "; ".join(f"{f.describe()} [{'; '.join(f.notes)}]" for f in injected))
    if not args.daemon:
        print(f"not injected by this soak: {', '.join(LEFT_OUT)} (--daemon runs that variant)")
    print(f"machine: nproc={os.cpu_count()}, load average now {os.getloadavg()[0]:.1f}")
    if args.json:
        print(json.dumps({"faults": [f.__dict__ for f in faults], "invariants": [v.__dict__ for v in results]},
                         indent=1, default=str))
    print(f"soak: {len(injected)} faults of {len({f.kind for f in injected})} kinds in {soak_min:.1f} min; "
          f"invariants broken: {broken}")
    return 0 if broken == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

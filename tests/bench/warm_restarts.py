"""Restarts of warm workers under `trainwarden run`, again and again: does any die of fork? (issue 45, item 3)

One `trainwarden run` (warm workers, the default) of tests/jobs/crash_loop.py with ``--max-restarts N``: in every
round but the last one rank exits (exit code 1 or 2, or SIGKILL with ``--crash kill``) at its third step, so torchrun
restarts the warm workers N times in the one run; the zygote forks every round's workers. Each round is judged
from the job's own record (a JSON line per rank and round: trained a step, crashed, finished; forked warm or
started cold), the supervisor's history (``events.jsonl``: each failed round's exit codes) and the run's log.

A round is *aborted* when
- a process of the run ended by a signal nobody sends it (``ABORT_SIGNALS``: SIGABRT, SIGSEGV, ...; the crash
  this job plans is an exit code or SIGKILL, and torch's agent stops the survivors with SIGTERM/SIGKILL): a
  worker, as its round's exit codes say (a warm worker's client dies of the same signal), or `trainwarden run`;
- the run's log holds a fatal error (``FATAL``: gRPC's ``Check failed`` / ``ev_epoll1_linux``, ``Fatal Python
  error``; from the zygote, torchrun, or a worker: whose it is the log does not say, so the round is the one whose
  workers last printed before it; a last-resort reading of log text, as no process reports its own abort);
- a rank did not train a step in it (a restart that did not get its workers to train again; a round the run
  never reached counts too), the last round did not finish, or the run did not succeed;
- its workers started cold with no word from the zygote why (``warm workers are off``): the zygote is gone.

The first launch's round counts like the N restarts'. Ends with ``warm restarts: N restarts, A aborted`` and exits
0 only when A is 0.

    python tests/bench/launch_stress.py --warm-restarts 200 [--nproc 2] [--keep DIR]
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
JOB_SCRIPT = HERE.parent / "jobs" / "crash_loop.py"
JOB = "warmrestarts"

ABORT_SIGNALS = frozenset({signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE,
                           signal.SIGSYS, signal.SIGTRAP})
"""Signals a process gets from its own fault or ``abort()``; nothing of the run sends them."""
FATAL = re.compile(r"Check failed|ev_epoll1_linux|Fatal Python error")
"""A process's last words before it aborts: gRPC's fatal check (its epoll engine after a fork), CPython's."""
WARM_OFF = "warm workers are off"
"""What the zygote says when it stops forking on purpose (runtime/zygote.py): then cold workers are no abort."""
ROUND_LINE = re.compile(r"crash_loop: restart (\d+) rank \d+ step \d+")


@dataclass
class Verdict:
    """The stress's outcome: each aborted round (0 is the launch, r the r-th restart) with why."""

    restarts: int
    problems: dict[int, list[str]] = field(default_factory=dict)
    restart_s: list[float] = field(default_factory=list)
    """Per restart: the planned crash to the new round's first completed step (the earliest rank's)."""
    cold_rounds: list[int] = field(default_factory=list)

    @property
    def aborted(self) -> int:
        return len(self.problems)

    def add(self, round_: int, why: str) -> None:
        whys = self.problems.setdefault(round_, [])
        if why not in whys:  # the same line in run.log and in the run's own output
            whys.append(why)

    def lines(self) -> list[str]:
        out = []
        if self.restart_s:
            out.append(f"warm restarts: crash -> first step of the next round: median "
                       f"{statistics.median(self.restart_s):.2f} s, max {max(self.restart_s):.2f} s "
                       f"({len(self.restart_s)} restarts timed)")
        if self.cold_rounds:
            out.append(f"rounds with workers started cold: {self.cold_rounds[:20]}")
        for round_, whys in sorted(self.problems.items())[:20]:
            out.append(f"round {round_} aborted: {'; '.join(whys)}")
        out.append(f"warm restarts: {self.restarts} restarts, {self.aborted} aborted")
        return out


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def judge(restarts: int, nproc: int, records: list[dict], events: list[dict], logs: list[str],
          rc: int | None) -> Verdict:
    """The verdict on one run of ``restarts`` planned crashes (module docstring). ``records``: the job's lines;
    ``events``: the supervisor's history events; ``logs``: the run's logs (run.log: torchrun's, the zygote's and
    the workers' output; `trainwarden run`'s own output); ``rc``: its exit code (negative: a signal; None: it did
    not end in time)."""
    verdict = Verdict(restarts)
    last = restarts
    ranks = set(range(nproc))
    by_round: dict[int, dict[str, dict[int, dict]]] = {}
    for rec in records:
        by_round.setdefault(int(rec["restart"]), {}).setdefault(rec["event"], {})[int(rec["rank"])] = rec
    for round_ in range(last + 1):
        seen = by_round.get(round_, {})
        trained = seen.get("step", {})
        if not trained:
            verdict.add(round_, "no rank trained a step" if round_ in by_round or round_ == 0 else
                        "the run never got to it")
        elif set(trained) != ranks:
            verdict.add(round_, f"rank(s) {sorted(ranks - set(trained))} did not train a step")
        if round_ < last and round_ in by_round and not seen.get("crash"):
            verdict.add(round_, "no rank crashed as planned")
        cold = sorted(rank for rank, rec in trained.items() if not rec.get("warm"))
        if cold:
            verdict.cold_rounds.append(round_)
            if not any(WARM_OFF in log for log in logs):
                verdict.add(round_, f"rank(s) {cold} started cold without a word from the zygote: it is gone")
        crash = next(iter(seen.get("crash", {}).values()), None)
        following = by_round.get(round_ + 1, {}).get("step", {})
        if crash is not None and following:
            verdict.restart_s.append(round(min(r["t"] for r in following.values()) - crash["t"], 3))
    if set(by_round.get(last, {}).get("finished", {})) != ranks and last in by_round:
        verdict.add(last, "the last round did not finish")
    failed = [e for e in events if e.get("event") == "round_failed"]
    for round_, event in enumerate(failed):
        for failure in event.get("failures") or []:
            code = failure.get("exitcode")
            if isinstance(code, int) and code < 0 and -code in ABORT_SIGNALS:
                verdict.add(round_, f"rank {failure.get('rank')} ended by {_signal_name(code)}")
        if round_ >= last:
            verdict.add(round_, "the last round failed")
    for log in logs:
        current = 0
        for line in log.splitlines():
            match = ROUND_LINE.search(line)
            if match:
                current = max(current, int(match.group(1)))
            elif FATAL.search(line):
                verdict.add(current, f"fatal error in the log: {line.strip()[:200]}")
    if rc is None:
        verdict.add(max(by_round, default=0), "the run did not end in time")
    elif rc < 0:
        verdict.add(max(by_round, default=0), f"trainwarden run ended by {_signal_name(rc)}")
    elif rc != 0:
        verdict.add(max(by_round, default=0), f"trainwarden run exited with {rc}")
    return verdict


def read_json_lines(path: Path) -> list[dict]:
    """Whole JSON lines of ``path`` (none when it does not exist); a torn line is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def run(restarts: int, nproc: int, work: Path, crash: str = "exit", timeout: float | None = None) -> Verdict:
    """One `trainwarden run` of the crash loop in ``work``; its verdict."""
    from _procs import run_in_session

    sys.path.insert(0, str(HERE.parent / "integration"))
    from gpt_helpers import gpt_env

    record = work / "record.jsonl"
    env = {**gpt_env(), "TRAINWARDEN_STATE_HOME": str(work / "state")}
    cmd = [sys.executable, "-m", "trainwarden.agent.cli", "run", "--nproc-per-node", str(nproc), "--job", JOB,
           "--metrics-port", "0", "--max-restarts", str(restarts), "--warm-workers", "--", str(JOB_SCRIPT),
           "--crashes", str(restarts), "--record", str(record), "--crash", crash]
    timeout = timeout if timeout is not None else 120 + 30 * restarts
    out_path = work / "output.log"
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    rc = run_in_session(cmd, env=env, log=out_path, timeout=timeout)
    state = work / "state" / "jobs" / JOB
    run_log = state / "logs" / "run.log"
    logs = [run_log.read_text(errors="replace") if run_log.exists() else "", out_path.read_text(errors="replace")]
    verdict = judge(restarts, nproc, read_json_lines(record), read_json_lines(state / "history" / "events.jsonl"),
                    logs, rc)
    print(f"warm restarts: one run of {restarts} restarts, {nproc} ranks, in {time.monotonic() - started:.0f} s "
          f"(rc {rc}); load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, {os.cpu_count()} "
          "cores", flush=True)
    return verdict


def main(restarts: int, nproc: int = 2, keep: Path | None = None, crash: str = "exit",
         timeout: float | None = None) -> int:
    work = Path(tempfile.mkdtemp(prefix="tw-warm-restarts-"))
    try:
        verdict = run(restarts, nproc, work, crash, timeout)
        for line in verdict.lines():
            print(line, flush=True)
        return 0 if verdict.aborted == 0 else 1
    finally:
        if keep is not None:
            try:
                shutil.copytree(work, keep, dirs_exist_ok=True, symlinks=True,
                                ignore=shutil.ignore_patterns("*.sock", "*.sock.*"))
            except (OSError, shutil.Error) as exc:
                print(f"warm restarts: not all of {work} was kept in {keep}: {exc}", flush=True)
        shutil.rmtree(work, ignore_errors=True)

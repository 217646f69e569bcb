"""Auto-instrumentation end to end: scripts that never import trainwarden (``tests/fixtures/unchanged``) under
`trainwarden run` (real torchrun, gloo on CPU, the in-process agent, 2 ranks).

For each script shape (issue 24): a DDP tutorial, FSDP2, gradient accumulation, two optimizers, a pipelining
schedule and an evaluation loop with collectives but no optimizer, one `trainwarden run` in which one rank is
SIGSTOPped mid-run:

- the stopped rank is named in the one hang incident, the job restarts (one restart incident) and exits 0;
- what the script printed is what it prints under plain torchrun, bit for bit: the first round's lines a
  prefix of it, the restarted round's all of it (the launcher's lines and the abort's left out);
- the summary counts one step per step of the primary optimizer (the evaluation loop: "collectives only").

One run per script rather than a clean run and a hang run each: the restarted round is a clean run to the
end (a false hang in it would be a second incident), and the module stays within a few minutes on 2 cores.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from procs import ProcessGroup, wait_for
from trainwarden.agent.incidents import list_incidents

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parents[1] / "fixtures" / "unchanged"
NPROC = 2


@dataclass(frozen=True)
class Script:
    """One unchanged script and how the test drives it: plain torchrun and `trainwarden run` run it with the
    same arguments."""

    file: str
    done_line: str
    """How the script's last line starts."""
    args: tuple[str, ...] = ()
    count_flag: str = "--steps"
    """The option that sets how many steps (or batches) it runs."""
    count: int = 20
    sleep: float = 0.1
    """Seconds the script sleeps per step (batch): steps long enough to stop a rank mid-run, short enough for
    the floor of the hang deadline (1.5 s)."""
    stop_after: int = 12
    """``stop_rank`` is stopped once the script printed this step's (batch's) line: past the hang
    detector's warm-up (3 steps; 64 collectives for a job without steps) and past a flush of the stopped rank's
    telemetry that holds steady steps (otherwise its start-up steps set the deadline: a slower detection)."""
    stop_rank: int = 1
    steps: bool = True
    """False: no optimizer, the summary must say "collectives only"."""

    def command(self) -> list[str]:
        return [str(FIXTURES / self.file), *self.args, self.count_flag, str(self.count), "--sleep", str(self.sleep)]


SCRIPTS = {
    "ddp_tutorial": Script("ddp_tutorial.py", "tutorial done"),
    "fsdp2": Script("fsdp2_mlp.py", "fsdp2 done", stop_rank=0),
    # 4 micro-batches per optimizer step: one step per optimizer.step(), never one per micro-batch
    "accumulate4": Script("ddp_tutorial.py", "tutorial done", ("--accumulate", "4")),
    # Adam steps first (the primary), then SGD: one step per iteration
    "two_optimizers": Script("ddp_tutorial.py", "tutorial done", ("--optimizers", "2"), stop_rank=0),
    "pipeline_gpipe": Script("pipeline_gpipe.py", "pipeline done"),
    # one all-reduce per batch: 64 of them before the detector follows the collectives
    "eval_collectives": Script("eval_allreduce.py", "eval done", count_flag="--batches", count=150, sleep=0.03,
                               stop_after=90, steps=False),
}

_LAUNCHER_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ |trainwarden: ")
"""The launcher's lines: its log records and its ``trainwarden:`` lines."""
_SUMMARY_LINE = re.compile(r"  [a-z][a-z ]* {2,}\S")
"""A line of the run summary, which follows ``trainwarden: job ... after ...``."""
_RECOVERY_LINE = re.compile(r"[WEI]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ |aborted by the trainwarden agent: ")
"""What a worker round's abort adds: torchrun's own log records, and the aborted worker's last word."""
_PRINTED_STEP = re.compile(r"^\[(\d{4})\] ", re.MULTILINE)


def script_lines(text: str) -> list[str]:
    """The script's own output lines in a `trainwarden run` log: the launcher's lines, its summary and what a
    hang's abort and the restart add left out."""
    lines, in_summary = [], False
    for line in text.splitlines():
        if _LAUNCHER_LINE.match(line):
            in_summary = line.startswith("trainwarden: job ")
            continue
        if in_summary and _SUMMARY_LINE.match(line):
            continue
        in_summary = False
        if _RECOVERY_LINE.match(line):
            continue
        lines.append(line)
    return lines


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINWARDEN_")}
    env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def wait(proc: subprocess.Popen, group: ProcessGroup, timeout: float) -> tuple[int, str]:
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        group.kill(proc)
        raise AssertionError(f"timed out after {timeout:.0f}s; log:\n{proc.log_path.read_text()[-4000:]}")
    return rc, proc.log_path.read_text(errors="replace")


def plain_torchrun(group: ProcessGroup, log: Path, command: list[str], timeout: float = 120) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}",
           "--log-dir", str(log.parent / "torchelastic"), *command]
    return wait(group.spawn(cmd, log=log, env=clean_env()), group, timeout)


def start_trainwarden(group: ProcessGroup, tmp_path: Path, job: str, command: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "trainwarden.agent.cli", "run", "--nproc-per-node", str(NPROC),
           "--max-restarts", "2", "--monitor-interval", "0.5", "--metrics-port", "0", "--job", job,
           "--state-home", str(tmp_path / "state"), "--", *command]
    return group.spawn(cmd, log=tmp_path / f"{job}.log", env=clean_env())


def incidents(tmp_path: Path, job: str) -> list:
    return list_incidents(tmp_path / "state", job)


def summary_steps(text: str) -> str:
    """What the run summary's ``steps`` line says."""
    match = re.search(r"^  steps +(.*)$", text, re.MULTILINE)
    assert match, f"no steps line in the summary:\n{text[-3000:]}"
    return match.group(1)


def assert_steps_counted(script: Script, text: str) -> None:
    steps = summary_steps(text)
    if script.steps:  # one step per step of the primary optimizer, indices from 0
        assert steps.startswith(f"last step {script.count - 1}, "), steps
        assert steps.endswith("(from optimizer hooks)"), steps
    else:
        assert steps.startswith("none (collectives only"), steps


def worker_of_rank(launcher: subprocess.Popen, rank: int, script: Path) -> psutil.Process | None:
    """The worker of ``rank`` running ``script`` among the launcher's descendants, or None while there is none.
    torch's agent started a process with RANK in its /proc/<pid>/environ: a cold worker, or a warm worker's
    client, whose worker the zygote forked (its pid map names the client: runtime/zygote.py)."""
    try:
        descendants = psutil.Process(launcher.pid).children(recursive=True)
    except psutil.Error:
        return None
    for proc in descendants:
        try:
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() not in environ or "--serve" in proc.cmdline() \
                    or str(script) not in proc.cmdline():
                continue
            if "trainwarden.runtime.zygote" not in proc.cmdline():
                return proc
            map_dir = next(Path(v.split(b"=", 1)[1].decode()) for v in environ
                           if v.startswith(b"TRAINWARDEN_WARM_MAP_DIR="))
            for entry in map_dir.iterdir():
                if entry.read_text().strip() == str(proc.pid):
                    return psutil.Process(int(entry.name))
        except (OSError, ValueError, StopIteration, psutil.Error):
            continue
    return None


SECOND_VARIANTS = {"ddp_tutorial", "accumulate4", "two_optimizers", "pipeline_gpipe", "eval_collectives"}
"""The step rule's other cases and other shapes, in the extended tier (30-80 s each): the default suite keeps FSDP2
here (a stopped rank named, the restart, the output bit for bit, the steps counted), and
test_a_collectives_only_job_is_not_taken_for_hung_between_its_reads below runs a job with collectives and no optimizer;
tests/unit/test_auto_instrument.py covers the rule itself. The DDP tutorial script still runs under `trainwarden run`
in test_hang_activity.py and tests/e2e/test_unchanged_straggler.py, its stopped rank is named and recovered under
plain torchrun in test_plain_torchrun.py, and a DDP job's stopped rank is named in tests/e2e/test_watchdog_e2e.py."""


@pytest.mark.timeout(10)
def test_the_scripts_never_import_trainwarden():
    for path in sorted({FIXTURES / script.file for script in SCRIPTS.values()}):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.split(".")[0] == "trainwarden"], f"{path.name} imports {names}"


def baseline(group: ProcessGroup, tmp_path: Path, script: Script) -> list[str]:
    """The script's output lines under plain torchrun."""
    rc, text = plain_torchrun(group, tmp_path / "torchrun.log", script.command())
    assert rc == 0, f"plain torchrun exited {rc}:\n{text[-4000:]}"
    lines = text.splitlines()
    assert lines and lines[-1].startswith(script.done_line), text[-4000:]
    return lines


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.extended) if name in SECOND_VARIANTS else name
                                  for name in SCRIPTS])
def test_unchanged_script_trains_the_same_and_a_stopped_rank_is_named_and_recovered(procs, tmp_path, name):
    script = SCRIPTS[name]
    expected = baseline(procs, tmp_path, script)
    launcher = start_trainwarden(procs, tmp_path, name, script.command())

    def printed(index: int) -> bool:
        if launcher.poll() is not None:
            raise AssertionError(f"the job ended ({launcher.returncode}) before step {index}:\n"
                                 f"{launcher.log_path.read_text()[-4000:]}")
        steps = _PRINTED_STEP.findall(launcher.log_path.read_text(errors="replace"))
        return bool(steps) and int(steps[-1]) >= index

    wait_for(lambda: printed(script.stop_after), timeout=120, what=f"step {script.stop_after}")
    victim = worker_of_rank(launcher, script.stop_rank, FIXTURES / script.file)
    assert victim is not None, f"no worker of rank {script.stop_rank} found"
    assert incidents(tmp_path, name) == []
    victim.send_signal(signal.SIGSTOP)
    rc, text = wait(launcher, procs, 240)
    assert rc == 0, text[-4000:]
    assert "trainwarden: could not" not in text, text[-4000:]  # auto-instrumentation's own warnings
    found = incidents(tmp_path, name)
    hangs = [i for i in found if i.kind.value == "hang"]
    assert len(hangs) == 1, found
    verdict = hangs[0].evidence.get("verdict", {})
    assert list(hangs[0].ranks) == [script.stop_rank], verdict
    assert verdict["unresponsive"] == {str(script.stop_rank): "stopped"}, verdict
    assert hangs[0].state.value == "resolved" and "abort" in hangs[0].action, hangs[0]
    assert sorted(i.kind.value for i in found) == ["hang", "restart"], found
    restarts = re.search(r"^  restarts +1 \((.*)\)$", text, re.MULTILINE)
    assert restarts and "not recovered" not in restarts.group(1), text[-3000:]
    # the first round printed the baseline's first lines, the restarted one all of them, bit for bit
    lines = script_lines(text)
    cut = len(lines) - len(expected)
    assert cut > script.stop_after, lines
    assert lines[:cut] == expected[:cut] and lines[cut:] == expected, text[-4000:]
    assert_steps_counted(script, text)


@pytest.mark.timeout(200)
def test_a_collectives_only_job_is_not_taken_for_hung_between_its_reads(procs, tmp_path):
    """An evaluation loop that all-reduces every 0.03 s, run for longer than the agent's quiet period (10 s: its
    ranks are then asked to read their Flight Recorders every 3 s). Its collectives are heard once a read, so
    before the collectives deadline allowed for that period the job was aborted as hung every few seconds, at
    the 2 s floor as at 1.5 s, and with its restarts spent it failed."""
    launcher = start_trainwarden(procs, tmp_path, "long_eval",
                                 [str(FIXTURES / "eval_allreduce.py"), "--batches", "600", "--sleep", "0.03"])
    rc, text = wait(launcher, procs, 180)
    assert rc == 0, text[-4000:]
    assert "eval done" in text and incidents(tmp_path, "long_eval") == [], text[-4000:]
    assert summary_steps(text).startswith("none (collectives only"), text[-3000:]

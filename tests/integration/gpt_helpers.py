"""Run the reference GPT workload under real torchrun (gloo, CPU) and read its per-step losses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GptRun", "final_line", "gpt_env", "parse_losses", "run_gpt", "run_user_loop"]

_STEP = re.compile(r"\bstep (\d+) loss (\S+) time ")
_DONE = re.compile(r"\bdone steps=(\d+) final_loss=(\S+)")


@dataclass(frozen=True)
class GptRun:
    """One finished torchrun invocation."""

    returncode: int
    log: str
    losses: dict[int, str]
    """Step -> loss exactly as printed (strings, so equality is bitwise at the printed precision)."""

    def describe(self) -> str:
        return f"rc={self.returncode}; last lines:\n" + "\n".join(self.log.splitlines()[-25:])


def parse_losses(text: str) -> dict[int, str]:
    """``{step: printed loss}`` from a run's output; a step printed twice must agree."""
    losses: dict[int, str] = {}
    for step, loss in _STEP.findall(text):
        if losses.setdefault(int(step), loss) != loss:
            raise AssertionError(f"step {step} printed twice with different losses {losses[int(step)]}, {loss}")
    return losses


def gpt_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINWARDEN_")}
    env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def run_gpt(group, log: Path, *, nproc: int, args: list[str], timeout: float = 240) -> GptRun:
    """Run ``torchrun --standalone --nproc-per-node nproc -m trainwarden.runtime.examples.gpt args`` in its
    own session (through ``group``, a ``tests/procs.ProcessGroup``) and wait for it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--log-dir", str(log.parent / "torchelastic"),  # not a torchelastic_* directory left in TMPDIR
           "-m", "trainwarden.runtime.examples.gpt", *args]
    proc = group.spawn(cmd, log=log, env=gpt_env())
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        group.kill(proc)
        proc.wait(10)
        raise AssertionError(f"torchrun did not finish in {timeout:.0f}s; log: {log}") from None
    text = log.read_text(errors="replace")
    return GptRun(returncode=rc, log=text, losses=parse_losses(text))


def final_line(text: str) -> tuple[int, str] | None:
    match = _DONE.search(text)
    return (int(match.group(1)), match.group(2)) if match else None


def run_user_loop(procs, tmp_path: Path, source: str, *, nproc: int, timeout: float = 150) -> str:
    """A user's own training script (``source``) under plain torchrun, ``nproc`` ranks on this machine; its output,
    once it exited 0."""
    script, log = tmp_path / "loop.py", tmp_path / "loop.log"
    script.write_text(source)
    proc = procs.spawn([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                        "--log-dir", str(tmp_path / "torchelastic"), str(script)], log=log, env=gpt_env())
    assert proc.wait(timeout) == 0, log.read_text()[-3000:]
    return log.read_text()

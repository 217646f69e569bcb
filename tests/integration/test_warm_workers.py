"""Warm workers (runtime/zygote.py): a real zygote (it imports torch) forks the workers that real client
processes ask for; exit codes, signals both ways, a killed client, the pid map and the cold fallback. The
training-level check (a crash under `trainwarden run --warm-workers` resumes to the uninterrupted losses) is
in test_gpt.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from procs import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SCRIPT = """
import os, signal, sys, time
import torch  # already imported in the zygote: free here
out = sys.argv[1]
with open(out, "w") as f:
    f.write(f"{os.getpid()} {os.getppid()} {os.environ.get('WARM_TEST', '')} {' '.join(sys.argv[2:])} "
            f"{torch.get_num_threads()} {__name__}\\n")
mode = sys.argv[2]
if mode == "exit":
    sys.exit(int(sys.argv[3]))
if mode == "raise":
    raise RuntimeError("boom")
if mode == "kill-self":
    os.kill(os.getpid(), signal.SIGTERM)
if mode == "sigkill-self":  # the crash fault: no handler can run
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "wait":
    def bye(signum, frame):
        with open(out + ".sig", "w") as f:
            f.write(str(signum))
        sys.exit(7)
    signal.signal(signal.SIGUSR1, bye)
    time.sleep(60)
"""


@pytest.fixture
def zygote(procs, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    sock, map_dir = str(tmp_path / "z.sock"), str(tmp_path / "map")
    proc = procs.spawn([sys.executable, "-m", "trainwarden.runtime.zygote", "--serve", sock, map_dir, str(script)],
                       log=tmp_path / "zygote.log")
    wait_for(lambda: os.path.exists(sock) or proc.poll() is not None, 60, what="the zygote to listen")
    assert proc.poll() is None, (tmp_path / "zygote.log").read_text()
    env = {**os.environ, "TRAINWARDEN_WARM_SOCKET": sock, "WARM_TEST": "from-client", "OMP_NUM_THREADS": "1"}
    yield script, env, map_dir, proc


def _client(script: Path, env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainwarden.runtime.zygote", str(script), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _report(path: Path) -> list[str]:
    wait_for(path.exists, 30, what=f"{path.name}")
    time.sleep(0.05)
    return path.read_text().split()


def test_the_worker_is_forked_from_the_zygote_and_exits_as_the_client(zygote, tmp_path):
    script, env, map_dir, z = zygote
    out = tmp_path / "a"
    client = _client(script, env, str(out), "exit", "3")
    assert client.wait(30) == 3, client.stderr.read()
    pid, ppid, marker, *rest = _report(out)
    assert int(ppid) == z.pid and int(pid) != client.pid  # forked by the zygote, not started by the client
    assert marker == "from-client" and rest == ["exit", "3", "1", "__main__"]  # env, argv, threads, __main__

    out = tmp_path / "b"
    client = _client(script, env, str(out), "raise")
    _, err = client.communicate(timeout=30)
    assert client.returncode == 1 and b"RuntimeError: boom" in err  # the traceback on the client's stderr

    client = _client(script, env, str(tmp_path / "c"), "kill-self")
    assert client.wait(30) == -signal.SIGTERM  # killed by the signal that killed the worker
    client = _client(script, env, str(tmp_path / "k"), "sigkill-self")
    assert client.wait(30) == -signal.SIGKILL, client.stderr.read()  # SIGKILL has no handler to reset first


def test_signals_reach_the_worker_and_a_killed_client_takes_its_worker_along(zygote, tmp_path):
    script, env, map_dir, z = zygote
    env = {**env, "TRAINWARDEN_JOB": "warmtest", "RANK": "3", "LOCAL_RANK": "1"}
    out = tmp_path / "w"
    client = _client(script, env, str(out), "wait")
    worker = int(_report(out)[0])
    assert Path(map_dir, str(worker)).read_text() == str(client.pid)  # what the supervisor's commit guard reads
    # ps and pgrep find a rank's worker by its title (its command line would be the zygote's)
    title = " ".join(psutil.Process(worker).cmdline())
    assert title.startswith("trainwarden worker job=warmtest rank=3 local_rank=1: ") and str(script) in title, title
    assert psutil.Process(worker).name() == "tw-rank-3"
    client.send_signal(signal.SIGUSR1)  # forwarded
    assert client.wait(30) == 7
    assert Path(str(out) + ".sig").read_text() == str(int(signal.SIGUSR1))
    wait_for(lambda: not Path(map_dir, str(worker)).exists(), 10, what="the map entry to go")

    out = tmp_path / "k"
    client = _client(script, env, str(out), "wait")
    worker = int(_report(out)[0])
    client.kill()
    client.wait(10)
    wait_for(lambda: not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE, 10,
             what="the worker of a SIGKILLed client to die")
    # and only that worker: the zygote serves on and forks the next client's worker (it used to die on the closed
    # connection, taking every worker along; that client then started cold)
    client = _client(script, env, str(tmp_path / "after"), "exit", "5")
    assert client.wait(30) == 5
    assert int(_report(tmp_path / "after")[1]) == z.pid and z.poll() is None, (tmp_path / "zygote.log").read_text()


def test_without_a_zygote_the_client_starts_cold(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "TRAINWARDEN_WARM_SOCKET": str(tmp_path / "nobody.sock"), "OMP_NUM_THREADS": "1"}
    client = _client(script, env, str(tmp_path / "cold"), "exit", "4")
    assert client.wait(60) == 4, client.stderr.read()
    pid, ppid, *_ = _report(tmp_path / "cold")
    assert int(pid) == client.pid  # exec'd in place: the client became the worker


def test_imports_that_start_a_thread_turn_warm_workers_off_and_clients_start_cold(procs, tmp_path):
    (tmp_path / "thready.py").write_text("import threading, time\n"
                                         "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    script = tmp_path / "job.py"
    script.write_text("import thready\n" + SCRIPT)
    sock = str(tmp_path / "z.sock")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    zygote = procs.spawn([sys.executable, "-m", "trainwarden.runtime.zygote", "--serve", sock,
                          str(tmp_path / "map"), str(script)], log=tmp_path / "zygote.log", env=env)
    assert zygote.wait(60) == 0
    assert "warm workers are off for this job: the job's imports started 1 Python thread(s)" in \
        (tmp_path / "zygote.log").read_text()
    client = _client(script, {**env, "TRAINWARDEN_WARM_SOCKET": sock}, str(tmp_path / "cold"), "exit", "5")
    assert client.wait(60) == 5
    assert int(_report(tmp_path / "cold")[0]) == client.pid  # started cold, in place


def test_imports_that_initialise_cuda_turn_warm_workers_off_and_clients_start_cold(procs, tmp_path):
    """A forked child cannot use CUDA its parent initialised: a script whose imports touch CUDA gets cold
    restarts and one line that says why (a fake module flips torch.cuda.is_initialized, as a real import
    that creates a CUDA context would)."""
    (tmp_path / "cudaish.py").write_text("import torch\ntorch.cuda.is_initialized = lambda: True\n")
    script = tmp_path / "job.py"
    script.write_text("import cudaish\n" + SCRIPT)
    sock = str(tmp_path / "z.sock")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    zygote = procs.spawn([sys.executable, "-m", "trainwarden.runtime.zygote", "--serve", sock,
                          str(tmp_path / "map"), str(script)], log=tmp_path / "zygote.log", env=env)
    assert zygote.wait(60) == 0
    log = (tmp_path / "zygote.log").read_text()
    assert "warm workers are off for this job: the job's imports initialised CUDA" in log, log
    assert not os.path.exists(sock) and os.path.exists(sock + ".off")  # first-round clients stop waiting
    client = _client(script, {**env, "TRAINWARDEN_WARM_SOCKET": sock}, str(tmp_path / "cold"), "exit", "6")
    assert client.wait(60) == 6
    assert int(_report(tmp_path / "cold")[0]) == client.pid  # started cold, in place


def test_a_first_round_client_waits_for_the_importing_zygote_and_is_forked(procs, tmp_path):
    """The first round's workers start beside the zygote: their clients wait while it imports torch, so the
    node imports it once, not once per rank."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    sock, map_dir = str(tmp_path / "z.sock"), str(tmp_path / "map")
    zygote = procs.spawn([sys.executable, "-m", "trainwarden.runtime.zygote", "--serve", sock, map_dir,
                          str(script)], log=tmp_path / "zygote.log")
    env = {**os.environ, "TRAINWARDEN_WARM_SOCKET": sock, "TRAINWARDEN_WARM_ZYGOTE_PID": str(zygote.pid),
           "TRAINWARDEN_WARM_WAIT_S": "600", "OMP_NUM_THREADS": "1"}
    assert not os.path.exists(sock)  # still importing torch
    client = _client(script, env, str(tmp_path / "first"), "exit", "3")
    assert client.wait(90) == 3, client.stderr.read()
    pid, ppid, *_ = _report(tmp_path / "first")
    assert int(ppid) == zygote.pid and int(pid) != client.pid  # forked, not started cold


def test_a_client_does_not_wait_for_a_zygote_that_died_or_said_it_will_not_fork(procs, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    env = {**os.environ, "TRAINWARDEN_WARM_SOCKET": str(tmp_path / "never.sock"), "OMP_NUM_THREADS": "1",
           "TRAINWARDEN_WARM_ZYGOTE_PID": str(gone.pid), "TRAINWARDEN_WARM_WAIT_S": "600"}
    client = _client(script, env, str(tmp_path / "dead"), "exit", "4")  # a 600 s wait would outlast the test
    assert client.wait(60) == 4 and int(_report(tmp_path / "dead")[0]) == client.pid
    alive = procs.spawn([sys.executable, "-c", "import time; time.sleep(120)"], log=tmp_path / "sleeper.log")
    (tmp_path / "off.sock.off").write_text("the job's imports initialised CUDA\n")
    env.update(TRAINWARDEN_WARM_SOCKET=str(tmp_path / "off.sock"), TRAINWARDEN_WARM_ZYGOTE_PID=str(alive.pid))
    client = _client(script, env, str(tmp_path / "off"), "exit", "5")
    assert client.wait(60) == 5 and int(_report(tmp_path / "off")[0]) == client.pid

"""A one-node `trainwarden run` is private to its user (issue 44, items 5 and 6), tried for real while a job runs.

Item 5: the embedded etcd's port is in every process's ``/proc/PID/cmdline``; a second uid (``nobody``) read it there
and wrote the running job's keys. Now etcd requires the root user's password, which is in a 0700 directory of the
run's user. Item 6: the workers' TCPStore listened on every interface; now only on loopback, so a client on another
address of the host is refused.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

import host_address
from job_users import unavailable as no_second_user
from procs import wait_for
from trainwarden.agent.etcd.client import EtcdSecurity, open_etcd

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

NOBODY = 65534

WORKER = textwrap.dedent("""
    import os, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    step = 0
    while True:
        seen = torch.tensor([1.0 if os.path.exists(os.environ["STOP_FILE"]) else 0.0])
        dist.all_reduce(seen)  # every rank stops at the same iteration
        if seen.item() > 0:
            break
        x = torch.ones(2)
        dist.all_reduce(x)
        step += 1
        if dist.get_rank() == 0:
            print(f"step {step} sum {x[0].item():.0f}", flush=True)
        time.sleep(0.1)
    dist.barrier()
    dist.destroy_process_group()
""")

ATTACKER = textwrap.dedent("""
    import json, os, sys
    from trainwarden.agent.etcd.client import EtcdUnavailable, describe_etcd_error, open_client

    state_home, key, password_file = sys.argv[1:4]
    try:  # load gRPC's lazily imported parts while this process may still read the interpreter's files
        open_client("127.0.0.1", 9, timeout=0.5, connect_timeout=0.2)
    except EtcdUnavailable:
        pass
    os.setgroups([])
    os.setresgid(65534, 65534, 65534)
    os.setresuid(65534, 65534, 65534)
    out = {"uid": os.getuid(), "ports": []}
    for pid in filter(str.isdigit, os.listdir("/proc")):  # what any local user can read
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\\0")
        except OSError:
            continue
        if argv[0].endswith("etcd") and "--listen-client-urls" in argv and any(state_home in a for a in argv):
            out["ports"].append(int(argv[argv.index("--listen-client-urls") + 1].rpartition(":")[2]))
    for port in out["ports"]:
        try:
            client = open_client("127.0.0.1", port, timeout=5.0)
            client.put(key, "forged")
            out["put"] = "written"
        except Exception as exc:
            out["put"] = describe_etcd_error(exc)
    try:
        with open(password_file) as f:
            out["password"] = "read " + str(len(f.read()))
    except OSError as exc:
        out["password"] = exc.strerror
    print(json.dumps(out))
""")


def _start(procs, tmp_path: Path, job: str):
    (tmp_path / "worker.py").write_text(WORKER)
    stop = tmp_path / "stop"
    env = {**os.environ, "TRAINWARDEN_STATE_HOME": str(tmp_path / "state"), "STOP_FILE": str(stop),
           "OMP_NUM_THREADS": "1"}
    run = procs.spawn([sys.executable, "-m", "trainwarden.agent.cli", "run", "--metrics-port", "0",
                       "--nproc-per-node", "2", "--job", job, "--", str(tmp_path / "worker.py")],
                      log=tmp_path / "run.log", env=env)
    wait_for(lambda: "step 3 " in (tmp_path / "run.log").read_text() or run.poll() is not None, 120,
             what="three steps")
    assert run.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
    return run, stop


def _finish(run, stop: Path, log: Path) -> None:
    stop.touch()
    assert run.wait(90) == 0, log.read_text()[-3000:]  # the job ran normally through the attack
    assert "completed" in log.read_text() or "succeeded" in log.read_text(), log.read_text()[-2000:]


def test_another_user_cannot_write_a_running_jobs_embedded_etcd(procs, tmp_path):
    if no_second_user():
        pytest.skip(no_second_user())
    run, stop = _start(procs, tmp_path, "priv")
    log = (tmp_path / "run.log").read_text()
    found = re.search(r"embedded etcd on (\S+) \(pid \d+; user (\S+), password in (\S+)\)", log)
    key = "/trainwarden/v1/rdzv/priv/forged"

    attack = subprocess.run([sys.executable, "-c", ATTACKER, str(tmp_path / "state"), key,
                             found.group(3) if found else "/nonexistent"],
                            capture_output=True, text=True, timeout=60)
    assert attack.returncode == 0, attack.stderr[-3000:]
    out = json.loads(attack.stdout.strip().splitlines()[-1])
    assert out["uid"] == NOBODY and len(out["ports"]) == 1, out  # it found the port, as before
    assert out["put"] != "written" and "user name is empty" in out["put"], out  # etcd wants a user now
    assert found, log[-2000:]
    endpoint, user, password_file = found.groups()
    assert out["password"] == "Permission denied", out
    assert oct(os.stat(password_file).st_mode & 0o777) == "0o600"
    assert oct(os.stat(os.path.dirname(password_file)).st_mode & 0o777) == "0o700"

    client = open_etcd(EtcdSecurity(user=user, password_file=password_file).config((endpoint,)))
    try:
        assert client.get(key)[0] is None  # nothing was written
    finally:
        client.close()
    _finish(run, stop, tmp_path / "run.log")


def test_the_workers_store_refuses_a_client_on_another_address_of_the_host(procs, tmp_path):
    if host_address.unavailable():
        pytest.skip(host_address.unavailable())
    run, stop = _start(procs, tmp_path, "lo")
    launchers = [p for p in psutil.Process(run.pid).children(recursive=True)
                 if "trainwarden.agent.launch.elastic" in " ".join(p.cmdline())]
    assert len(launchers) == 1, [p.cmdline() for p in psutil.Process(run.pid).children(recursive=True)]
    listening = [c.laddr for c in launchers[0].net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
    assert listening, "torchrun's agent hosts the workers' store: it listens on a port"
    with host_address.other_address() as other:
        reached = [(addr.ip, addr.port) for addr in listening if host_address.connects(other, addr.port)]
    assert not reached, f"the workers' store answers on {other}: listening on {reached}"
    assert all(addr.ip == "127.0.0.1" for addr in listening), listening
    _finish(run, stop, tmp_path / "run.log")

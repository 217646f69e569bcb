"""A submitted job runs as its user (issue 30, item 1): a real root `trainwarden agent` daemon, real etcd on loopback,
and the reference GPT under `trainwarden run` and torchrun as the unprivileged user ``nobody``.

Before this, the daemon ran whatever a spec in etcd said as root. Now the spec's ``user`` (or the node's
``job_user``) is who the launcher and every worker run as, with no capabilities and no-new-privileges; its state
directory, log and checkpoints are the user's; telemetry, the watchdog (a hang named, its stacks dumped, the group
aborted), checkpoints and warm restarts keep working.
Root, or a job with no user on an agent with no ``job_user``, is refused with a phase and one incident that say why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.request
from pathlib import Path

import psutil
import pytest

from job_users import NOBODY, interpreter_for_others, shared_dir, unavailable
from procs import wait_for
from test_daemon_jobs import Daemons, _cli, _jobs, _steps

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

if unavailable():
    pytest.skip(unavailable(), allow_module_level=True)

NOBODY_UID = 65534


@pytest.fixture
def shared(procs):
    """Where nobody may go: the daemon's state home and the checkpoints (pytest's tmp_path is 0700)."""
    path = shared_dir("tw-jobuser-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemons(procs, shared, etcd_server):
    d = Daemons(procs, shared, etcd_server.endpoint)
    try:
        yield d
    finally:
        d.close()


def _toml(value) -> str:
    if isinstance(value, dict):  # an inline table
        return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def _write_spec(path: Path, **fields) -> Path:
    path.write_text("\n".join(f"{k} = {_toml(v)}" for k, v in fields.items()) + "\n")
    return path


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def test_a_job_runs_as_its_user_with_telemetry_diagnostics_checkpoints_and_a_warm_restart(daemons, shared,
                                                                                          etcd_server):
    etcd = etcd_server.endpoint
    ckpt = shared / "ckpt"
    ckpt.mkdir()
    os.chown(ckpt, NOBODY_UID, NOBODY_UID)
    daemons.start("n0", users=(), wrap=tuple(interpreter_for_others()))  # no job_user: the spec names its user
    metrics = re.search(r"metrics (http://127\.0\.0\.1:\d+/metrics)", daemons.log("n0")).group(1)
    spec = _write_spec(shared / "ju.toml", name="ju", user=NOBODY, nnodes="1", nproc_per_node=2, max_restarts=2,
                       checkpoint_dir=str(ckpt), env={"TRAINWARDEN_FAULTS": "hang:rank=1,step=16"},
                       command=["-m", "trainwarden.runtime.examples.gpt", "--batch", "4", "--steps", "30",
                                "--ckpt-every", "5"])
    out = _cli("submit", str(spec), etcd=etcd)
    assert out.returncode == 0, out.stderr

    def relayed_step() -> float:
        text = urllib.request.urlopen(metrics, timeout=10).read().decode()
        found = re.findall(r'trainwarden_last_step\{[^}]*job="ju"[^}]*\} ([\d.e+]+)', text)
        return max(map(float, found)) if found else 0.0

    wait_for(lambda: max(_steps(daemons.job_log("n0", "ju")) or [0]) >= 5, 240, what="ju to reach step 5")
    (launcher,) = daemons.launchers("n0").values()
    tree = [psutil.Process(launcher["pid"]), *psutil.Process(launcher["pid"]).children(recursive=True)]
    assert len(tree) >= 4, tree  # launcher, torchrun (and the warm zygote), two workers
    for proc in tree:
        assert proc.uids().real == proc.uids().effective == NOBODY_UID, (proc.pid, proc.cmdline())
        assert proc.gids().real == NOBODY_UID
    launched = _status(launcher["pid"])
    assert launched["NoNewPrivs"] == "1" and int(launched["CapEff"], 16) == 0 and int(launched["CapPrm"], 16) == 0
    wait_for(lambda: relayed_step() >= 5, 60, what="the daemon's metrics to relay ju's steps (telemetry as nobody)")

    wait_for(lambda: _jobs(etcd)["ju"]["phase"] in ("succeeded", "failed", "refused"), 300, what="ju to finish")
    text = daemons.job_log("n0", "ju")
    assert _jobs(etcd)["ju"]["phase"] == "succeeded", text[-3000:]
    assert "starts job ju generation 1 as nobody (uid 65534)" in text
    story = [line for line in text.splitlines() if re.search(r"aside|resum|warm|hang|restart", line)]
    resumed = re.findall(r"resumed from checkpoint step (\d+)", text)  # the hang, then a warm restart from it
    assert resumed and int(resumed[-1]) >= 5 and "warm worker pid" in text, "\n".join(story)
    state = shared / "n0" / "jobs" / "ju"
    found = [json.loads(p.read_text()) for p in (state / "incidents").glob("*.json")]
    (hang,) = [i for i in found if i["kind"] == "hang"]
    assert hang["ranks"] == [1] and hang["state"] == "resolved", hang
    dumps = [p for p in Path(hang["evidence"]["diagnostics_dir"]).rglob("*") if p.is_file()]
    assert dumps and all(p.stat().st_uid == NOBODY_UID for p in dumps), dumps  # the watchdog's, as nobody
    steps = _steps(text)
    assert steps[-1] == 30 and sorted(set(steps)) == list(range(1, 31)), steps
    owned = [p for p in ckpt.rglob("*")]
    assert owned and all(p.lstat().st_uid == NOBODY_UID for p in owned), [
        (p, p.lstat().st_uid) for p in owned if p.lstat().st_uid != NOBODY_UID][:5]
    assert state.stat().st_uid == NOBODY_UID
    assert (shared / "n0" / "daemon" / "logs" / "ju.log").stat().st_uid == NOBODY_UID


def test_root_and_a_job_with_no_user_are_refused_with_the_reason(daemons, shared, etcd_server):
    etcd = etcd_server.endpoint
    daemons.start("n0", users=())  # a root daemon with no job_user and no allow_root_jobs: the shipped default
    script = shared / "hello.py"
    script.write_text("print('this must not run', flush=True)\n")
    _write_spec(shared / "asroot.toml", name="asroot", user="root", command=[str(script)])
    _write_spec(shared / "nouser.toml", name="nouser", command=[str(script)])
    for name in ("asroot", "nouser"):
        assert _cli("submit", str(shared / f"{name}.toml"), etcd=etcd).returncode == 0
    wait_for(lambda: {_jobs(etcd)[j]["phase"] for j in ("asroot", "nouser")} == {"refused"}, 60,
             what="both jobs to be refused")
    jobs = _jobs(etcd)
    assert "would run as root" in json.dumps(jobs["asroot"]) and "allow_root_jobs" in json.dumps(jobs["asroot"])
    assert "names no user" in json.dumps(jobs["nouser"]) and "job_user" in json.dumps(jobs["nouser"])
    for name in ("asroot", "nouser"):
        incidents = list((shared / "n0" / "daemon" / "records" / name / "incidents").glob("*.json"))
        assert [json.loads(p.read_text())["kind"] for p in incidents] == ["job_refused"], incidents
        assert "this must not run" not in daemons.job_log("n0", name)

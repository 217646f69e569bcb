"""etcd's roles for trainwarden (issue 30, item 4), made by the shipped scripts and enforced by a real etcd.

``deploy/etcd/make-certs.sh`` makes the CA and the certificates, a real etcd serves https on loopback with
``--client-cert-auth`` (each client is the user its certificate names: no password anywhere), and
``deploy/etcd/roles.sh`` makes the roles and turns auth on. Then: a submitter submits but etcd refuses it the
rendezvous keys (torch's pickled state) and the node records; a reader reads and writes nothing; a real job runs
with nothing but the agents' certificate, so that role covers all a launcher writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from procs import ProcessGroup, wait_for
from tls_etcd import spawn_tls_etcd

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def roles_etcd(tmp_path_factory):
    """(url, certificate directory) of the TLS etcd with the roles made. One for the module (~11 s to make the
    certificates and the roles and start etcd): its two tests work on jobs of their own names."""
    workdir = tmp_path_factory.mktemp("roles-etcd")
    procs = ProcessGroup()
    try:
        certs = workdir / "certs"
        made = subprocess.run(["bash", str(ROOT / "deploy" / "etcd" / "make-certs.sh"), str(certs), "127.0.0.1",
                               "localhost"], capture_output=True, text=True, timeout=120)
        assert made.returncode == 0, made.stderr
        assert oct((certs / "trainwarden-agent-key.pem").stat().st_mode & 0o777) == "0o600"
        url = spawn_tls_etcd(procs, workdir, name="roles", cert=certs / "server.pem", key=certs / "server-key.pem",
                             ca=certs / "ca.pem")
        wait_for(lambda: _etcdctl(url, certs, "root", "endpoint", "health").returncode == 0, 30, what="the TLS etcd")
        roles = subprocess.run(["bash", str(ROOT / "deploy" / "etcd" / "roles.sh"), url, str(certs)],
                               capture_output=True, text=True, timeout=120,
                               env={**os.environ, "ETCDCTL": str(BIN / "etcdctl")})
        assert roles.returncode == 0, roles.stderr
        again = subprocess.run(["bash", str(ROOT / "deploy" / "etcd" / "roles.sh"), url, str(certs)],
                               capture_output=True, text=True, timeout=120,
                               env={**os.environ, "ETCDCTL": str(BIN / "etcdctl")})
        assert again.returncode == 0, again.stderr  # running it again is harmless
        yield url, certs
    finally:
        procs.close()


def _etcdctl(url: str, certs: Path, user: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "etcdctl"), "--endpoints", url, "--cacert", str(certs / "ca.pem"),
                           "--cert", str(certs / f"{user}.pem"), "--key", str(certs / f"{user}-key.pem"),
                           "--dial-timeout", "3s", *args], capture_output=True, text=True, timeout=30)


def _as(user: str, url: str, certs: Path) -> list[str]:
    return ["--etcd", url, "--etcd-ca", str(certs / "ca.pem"), "--etcd-cert", str(certs / f"{user}.pem"),
            "--etcd-key", str(certs / f"{user}-key.pem")]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainwarden.agent.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_a_submitter_submits_but_etcd_refuses_it_the_rendezvous_and_a_reader_writes_nothing(roles_etcd, tmp_path):
    url, certs = roles_etcd
    spec = tmp_path / "job.toml"
    spec.write_text('name = "rj"\ncommand = ["train.py"]\nnodes = ["n0"]\n')
    submitted = _cli("submit", str(spec), *_as("trainwarden-submitter", url, certs))
    assert submitted.returncode == 0 and "submitted job rj" in submitted.stdout, submitted.stderr
    assert _cli("stop", "rj", *_as("trainwarden-submitter", url, certs)).returncode == 0

    for key in ("/trainwarden/v1/rdzv/rj/state", "/trainwarden/v1/rdzv/rj/store/k", "/trainwarden/v1/nodes/n0"):
        refused = _etcdctl(url, certs, "trainwarden-submitter", "put", key, "forged")
        assert refused.returncode != 0 and "permission denied" in refused.stderr, (key, refused.stdout, refused.stderr)
    assert _etcdctl(url, certs, "trainwarden-agent", "put", "/trainwarden/v1/rdzv/rj/state", "x").returncode == 0
    assert _etcdctl(url, certs, "trainwarden-submitter", "put", "/elsewhere", "x").returncode != 0  # only the prefix
    cordon = _cli("cordon", "n0", "--reason", "x", *_as("trainwarden-submitter", url, certs))
    assert cordon.returncode == 3 and "needs a user with write access" in cordon.stderr, cordon.stderr

    listed = _cli("jobs", "--json", *_as("trainwarden-reader", url, certs))
    assert listed.returncode == 0 and "rj" in {j["job"] for j in json.loads(listed.stdout)}, listed.stderr
    for args in (["submit", str(spec)], ["resume", "rj"]):
        refused = _cli(*args, *_as("trainwarden-reader", url, certs))
        assert refused.returncode == 3 and "needs a user with write access" in refused.stderr, (args, refused.stderr)
    as_reader = _etcdctl(url, certs, "trainwarden-reader", "put", "/trainwarden/v1/jobs/rj/spec", "{}")
    assert as_reader.returncode != 0 and "permission denied" in as_reader.stderr


def test_a_job_runs_with_the_agents_certificate_alone(roles_etcd, tmp_path, procs):
    url, certs = roles_etcd
    log = tmp_path / "run.log"
    run = procs.spawn([sys.executable, "-m", "trainwarden.agent.cli", "run", "--job", "rolesjob",
                       "--nproc-per-node", "2", "--metrics-port", "0", "--cold-workers",
                       *_as("trainwarden-agent", url, certs), "--",
                       "-m", "trainwarden.runtime.examples.gpt", "--batch", "4", "--steps", "8", "--ckpt-every", "4",
                       "--ckpt-dir", str(tmp_path / "ckpt")],
                      log=log, env={**os.environ, "TRAINWARDEN_STATE_HOME": str(tmp_path / "state")})
    assert run.wait(240) == 0, log.read_text()[-3000:]
    state = _etcdctl(url, certs, "trainwarden-reader", "get", "/trainwarden/v1/jobs/rolesjob/state", "--print-value-only")
    assert json.loads(state.stdout)["phase"] == "succeeded", state.stdout + state.stderr
    pointer = _etcdctl(url, certs, "trainwarden-reader", "get", "/trainwarden/v1/jobs/rolesjob/checkpoint",
                       "--print-value-only")
    assert json.loads(pointer.stdout)["step"] == 8, pointer.stdout  # the commits went through with its role
    rdzv = _etcdctl(url, certs, "trainwarden-reader", "get", "--prefix", "--keys-only", "/trainwarden/v1/rdzv/rolesjob/")
    keys = rdzv.stdout.split()  # its rendezvous, in rdzv/: the etcd-native round, trainwarden run's default
    assert "/trainwarden/v1/rdzv/rolesjob/rounds/00000000/close/members" in keys, rdzv.stdout

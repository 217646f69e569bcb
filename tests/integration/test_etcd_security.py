"""etcd with TLS (mutual) and authentication: every client trainwarden opens takes the same settings.

Issue 9, defect 13: TLS/auth reached only the rendezvous, and the password travelled in rdzv-conf (torchrun's
command line, its log) or an environment variable every worker inherited. A real etcd here serves only
https on loopback, demands a client certificate and has auth enabled; a job runs against it with
``trainwarden run --etcd https://... --etcd-ca/--etcd-cert/--etcd-key/--etcd-user/--etcd-password-file``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from procs import wait_for
from trainwarden.agent.etcd.client import EtcdAccessDenied, EtcdSecurity, EtcdUnavailable
from tls_etcd import spawn_tls_etcd
from trainwarden.agent.etcd.job_records import connect

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

BIN = Path(sys.executable).parent
PASSWORD = "s3cret-Do-not-Log-7731"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificates(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=trainwarden-test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    for name, cn, ext in (("server", "127.0.0.1", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
                          ("client", "trainwarden-client", "extendedKeyUsage=clientAuth")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=d)
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)


@pytest.fixture
def secure_etcd(tmp_path, procs):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test certificates")
    tls = tmp_path / "tls"
    tls.mkdir()
    _certificates(tls)
    url = spawn_tls_etcd(procs, tmp_path, name="secure", cert=tls / "server.pem", key=tls / "server.key",
                         ca=tls / "ca.pem")
    ctl = [str(BIN / "etcdctl"), "--endpoints", url, "--cacert", str(tls / "ca.pem"), "--cert",
           str(tls / "client.pem"), "--key", str(tls / "client.key"), "--dial-timeout", "2s"]

    def healthy() -> bool:
        return subprocess.run([*ctl, "endpoint", "health"], capture_output=True).returncode == 0

    wait_for(healthy, 30, what="the TLS etcd")
    subprocess.run([*ctl, "user", "add", f"root:{PASSWORD}"], check=True, capture_output=True)
    subprocess.run([*ctl, "auth", "enable"], check=True, capture_output=True)
    password_file = tmp_path / "etcd-password"
    password_file.write_text(PASSWORD + "\n")
    password_file.chmod(0o600)
    security = EtcdSecurity(ca_cert=str(tls / "ca.pem"), cert_cert=str(tls / "client.pem"),
                            cert_key=str(tls / "client.key"), user="root", password_file=str(password_file))
    return url, security


def test_clients_take_tls_and_auth_and_say_which_part_is_wrong(secure_etcd, tmp_path):
    url, security = secure_etcd
    client = connect(security.config((url,)))
    try:
        client.put("/trainwarden/v1/_probe", b"ok")
        assert client.get("/trainwarden/v1/_probe")[0] == b"ok"
    finally:
        client.close()
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password\n")
    bad = EtcdSecurity(**{**security.__dict__, "password_file": str(wrong)})
    with pytest.raises(EtcdAccessDenied, match="refused the credentials of user 'root'"):
        connect(bad.config((url,)))
    # TLS without the client certificate: etcd drops the handshake; nothing answers
    no_cert = EtcdSecurity(ca_cert=security.ca_cert, user="root", password_file=security.password_file)
    with pytest.raises(EtcdUnavailable):
        connect(no_cert.config((url,), connect_timeout=1.0))
    with pytest.raises(ValueError, match="--etcd-user and --etcd-password-file go together"):
        EtcdSecurity(ca_cert=security.ca_cert, user="root").config((url,))


WORKER = '''
import os, sys, time
import torch, torch.distributed as dist
import trainwarden.runtime

password = {password!r}
dist.init_process_group("gloo")
leaks = [k for k, v in os.environ.items() if password in v]
cmdlines = [open(f"/proc/{{pid}}/cmdline", "rb").read() for pid in (os.getpid(), os.getppid())]
leaks += ["cmdline" for c in cmdlines if password.encode() in c]
with open(os.path.join({out!r}, f"rank{{dist.get_rank()}}.json"), "w") as f:
    f.write(repr(leaks))
rt = trainwarden.runtime.init(mesh={{"dp": dist.get_world_size()}})
for step in range(1, 6):
    with rt.step(step):
        t = torch.ones(1)
        dist.all_reduce(t)
        time.sleep(0.05)
rt.close()
dist.destroy_process_group()
'''


def test_a_job_runs_against_an_etcd_with_tls_and_auth_and_the_password_goes_nowhere(secure_etcd, tmp_path, procs):
    url, security = secure_etcd
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(password=PASSWORD, out=str(out)))
    env = dict(os.environ, TRAINWARDEN_STATE_HOME=str(tmp_path / "state"))
    log = tmp_path / "run.log"
    run = procs.spawn([sys.executable, "-m", "trainwarden.agent.cli", "run", "--metrics-port", "0",
                       "--nproc-per-node", "2", "--job", "secure", "--etcd", url,
                       "--etcd-ca", security.ca_cert, "--etcd-cert", security.cert_cert,
                       "--etcd-key", security.cert_key, "--etcd-user", security.user,
                       "--etcd-password-file", security.password_file, "--", str(script)], log=log, env=env)
    assert run.wait(180) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "job secure succeeded" in text and "last step 5" in text
    # the rendezvous went through the secure etcd too: torchrun was told the file, not the password
    assert "password_file=" in text and "protocol=https" in text
    assert PASSWORD not in text
    assert sorted(p.name for p in out.iterdir()) == ["rank0.json", "rank1.json"]
    assert all(p.read_text() == "[]" for p in out.iterdir()), [p.read_text() for p in out.iterdir()]
    # the run's records reached etcd through the same TLS and auth settings
    client = connect(security.config((url,)))
    try:
        state = json.loads(client.get("/trainwarden/v1/jobs/secure/state")[0])
    finally:
        client.close()
    assert state["phase"] == "succeeded"


def test_a_password_in_the_environment_is_refused_with_what_to_do_instead(secure_etcd, tmp_path, procs):
    url, _ = secure_etcd
    env = dict(os.environ, TRAINWARDEN_STATE_HOME=str(tmp_path / "state"), TRAINWARDEN_ETCD_PASSWORD=PASSWORD)
    log = tmp_path / "run.log"
    run = procs.spawn([sys.executable, "-m", "trainwarden.agent.cli", "run", "--job", "envpw", "--etcd", url, "--",
                       "x.py"], log=log, env=env)
    assert run.wait(60) == 2
    text = log.read_text()
    assert "TRAINWARDEN_ETCD_PASSWORD is not read" in text and "TRAINWARDEN_ETCD_PASSWORD_FILE" in text
    assert PASSWORD not in text


def test_a_read_only_user_can_list_jobs_but_not_submit_stop_or_cordon(secure_etcd, tmp_path):
    """issue 11, access: the fleet commands change state only with write access to the trainwarden prefix."""
    url, security = secure_etcd
    ctl = [str(BIN / "etcdctl"), "--endpoints", url, "--cacert", security.ca_cert, "--cert", security.cert_cert,
           "--key", security.cert_key, "--user", f"root:{PASSWORD}", "--dial-timeout", "2s"]
    for args in (["user", "add", "viewer:viewer-pw"], ["role", "add", "readonly"],
                 ["role", "grant-permission", "readonly", "--prefix=true", "read", "/trainwarden/v1/"],
                 ["user", "grant-role", "viewer", "readonly"]):
        subprocess.run([*ctl, *args], check=True, capture_output=True)
    viewer_pw = tmp_path / "viewer-password"
    viewer_pw.write_text("viewer-pw\n")
    viewer_pw.chmod(0o600)
    tls = ["--etcd", url, "--etcd-ca", security.ca_cert, "--etcd-cert", security.cert_cert,
           "--etcd-key", security.cert_key]
    as_root = [*tls, "--etcd-user", "root", "--etcd-password-file", security.password_file]
    as_viewer = [*tls, "--etcd-user", "viewer", "--etcd-password-file", str(viewer_pw)]
    spec = tmp_path / "job.toml"
    spec.write_text('name = "ro"\ncommand = ["train.py"]\n')

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "trainwarden.agent.cli", *args], capture_output=True, text=True,
                              timeout=60)

    assert cli("submit", str(spec), *as_root).returncode == 0
    listed = cli("jobs", *as_viewer)
    assert listed.returncode == 0 and "ro" in listed.stdout and "pending" in listed.stdout, listed.stderr
    assert cli("nodes", *as_viewer).returncode == 0
    other = tmp_path / "other.toml"
    other.write_text('name = "ro2"\ncommand = ["train.py"]\n')
    for args in (["stop", "ro"], ["cordon", "n0", "--reason", "x"], ["submit", str(other)]):
        refused = cli(*args, *as_viewer)
        assert refused.returncode == 3, (args, refused.stdout, refused.stderr)
        assert "needs a user with write access" in refused.stderr, refused.stderr
    assert cli("stop", "ro", *as_root).returncode == 0

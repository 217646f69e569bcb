"""A daemon-run job's worker that tries, as the job's user, what that user can do in etcd with what it can read
(tests/integration/test_job_etcd_identity.py), then trains the reference GPT (its arguments are the GPT's).

The credential is the one its launcher was given: the ``--etcd*`` flags of the nearest ancestor running
``trainwarden run --managed`` (its command line, as any process of the job's user can read it), else the launcher's
``TRAINWARDEN_ETCD_*`` variables. With it the worker puts its own job's key and the victim's ``jobs/`` and ``rdzv/``
keys, and tries to read every credential file it knows of. It prints one line, ``PROBE {json}``.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

P = "/trainwarden/v1"
FLAGS = {"--etcd": "etcd", "--etcd-ca": "ca_cert", "--etcd-cert": "cert_cert", "--etcd-key": "cert_key",
         "--etcd-user": "user", "--etcd-password-file": "password_file"}


def _launcher() -> tuple[list[str], dict[str, str]]:
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode() for a in f.read().split(b"\0") if a]
        if "--managed" in argv:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.decode().partition("=")[::2] for e in f.read().split(b"\0") if e)
            return argv, env
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rpartition(")")[2].split()[1])
    raise SystemExit("no `trainwarden run --managed` above this worker")


def _try(what) -> str:
    try:
        what()
        return "done"
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        from trainwarden.agent.etcd.client import describe_etcd_error

        return describe_etcd_error(exc)


def probe(job: str, victim: str) -> dict:
    from trainwarden.agent.etcd.client import EtcdConfig, open_etcd

    argv, env = _launcher()
    given = {name: argv[i + 1] for i, a in enumerate(argv[:-1]) for flag, name in FLAGS.items() if a == flag}
    for name, var in (("ca_cert", "TRAINWARDEN_ETCD_CA"), ("cert_cert", "TRAINWARDEN_ETCD_CERT"),
                      ("cert_key", "TRAINWARDEN_ETCD_KEY"), ("user", "TRAINWARDEN_ETCD_USER"),
                      ("password_file", "TRAINWARDEN_ETCD_PASSWORD_FILE")):
        given.setdefault(name, env.get(var))
    out = {"uid": os.getuid(), "launcher": argv, "credential": given, "reads": {}}
    for name in ("ca_cert", "cert_cert", "cert_key", "password_file"):
        if given.get(name):
            out["reads"][given[name]] = _try(lambda: open(given[name], "rb").close())
    endpoint = given.pop("etcd")
    client = open_etcd(EtcdConfig(endpoints=(endpoint,), **{k: v for k, v in given.items() if v}))
    try:
        out["puts"] = {key: _try(lambda: client.put(key, "written by another job's user")) for key in (
            f"{P}/jobs/{job}/probe", f"{P}/jobs/{victim}/spec", f"{P}/rdzv/{victim}/state",
            f"{P}/jobs/.index/{victim}", f"{P}/jobs/{job}/spec")}
        out["gets"] = {key: _try(lambda: client.get(key)) for key in (f"{P}/jobs/{job}/spec",
                                                                       f"{P}/jobs/{victim}/spec")}
    finally:
        client.close()
    return out


def main() -> None:
    print("PROBE " + json.dumps(probe(os.environ["TRAINWARDEN_JOB"], "victim")), flush=True)
    sys.argv = ["gpt", *sys.argv[1:]]
    runpy.run_module("trainwarden.runtime.examples.gpt", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

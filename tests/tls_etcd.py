"""A real etcd serving https on loopback that demands a client certificate, for the TLS and role tests."""

from __future__ import annotations

import sys
from pathlib import Path

from trainwarden.agent.etcd.embedded import free_port

BIN = Path(sys.executable).parent


def spawn_tls_etcd(procs, workdir: Path, *, name: str, cert: Path, key: str | Path, ca: Path) -> str:
    """Start it under ``procs`` (stopped with them); its client URL. ``cert``/``key``: the server's; ``ca``: the CA
    client certificates must be signed by (``--client-cert-auth``). The caller waits for it to answer."""
    port, peer = free_port(), free_port()
    url = f"https://127.0.0.1:{port}"
    procs.spawn([str(BIN / "etcd"), "--name", name, "--data-dir", str(workdir / "etcd-data"),
                 "--listen-client-urls", url, "--advertise-client-urls", url,
                 "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-cluster", f"{name}=http://127.0.0.1:{peer}",
                 "--cert-file", str(cert), "--key-file", str(key), "--trusted-ca-file", str(ca), "--client-cert-auth"],
                log=workdir / "etcd.log")
    return url

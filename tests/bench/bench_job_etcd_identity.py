"""What a launch pays for its own etcd user (issue 44, item 8): the daemon's grant before the launcher starts, the
launcher's first connection as that user, and the revocation when the daemon reaps it.

    python tests/bench/bench_job_etcd_identity.py --launches 50

Against the embedded etcd with authentication (``--bcrypt-cost 4``, agent/etcd/embedded_auth.py), as root. A grant
is ``JobEtcdIdentities.grant`` (a revocation of any leftover: two deletes; the password file; a role add, five
permission grants, a user add, a role grant); the connection is ``connect`` (Authenticate and the probe read); a
revocation is ``JobEtcdIdentities.revoke`` (two deletes and the directory's removal).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trainwarden.agent.etcd.client import EtcdConfig, open_etcd  # noqa: E402
from trainwarden.agent.etcd.embedded import EmbeddedEtcd  # noqa: E402
from trainwarden.agent.etcd.job_records import connect  # noqa: E402
from trainwarden.agent.node.job_etcd_identity import JobEtcdIdentities  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=50, help="grants, connections and revocations (default 50)")
    args = parser.parse_args()
    times: dict[str, list[float]] = {"grant": [], "connect": [], "revoke": []}
    with tempfile.TemporaryDirectory(prefix="bench-job-etcd-") as tmp:
        tmp = Path(tmp)
        etcd = EmbeddedEtcd(data_dir=tmp / "data", log_path=tmp / "etcd.log", auth_dir=tmp / "auth")
        etcd.start()
        try:
            root = open_etcd(etcd.security.config((etcd.endpoint,)))
            identities = JobEtcdIdentities(root, node="n0", state_home=tmp / "home", launcher_args=[])
            try:
                for generation in range(1, args.launches + 1):
                    began = time.monotonic()
                    flags = identities.grant("bench", generation, os.getuid(), os.getgid())
                    granted = time.monotonic()
                    user, password_file = flags[flags.index("--etcd-user") + 1], flags[-1]
                    client = connect(EtcdConfig(endpoints=(etcd.endpoint,), user=user, password_file=password_file))
                    connected = time.monotonic()
                    client.close()
                    closed = time.monotonic()
                    identities.revoke("bench", generation)
                    revoked = time.monotonic()
                    times["grant"].append(granted - began)
                    times["connect"].append(connected - granted)
                    times["revoke"].append(revoked - closed)
            finally:
                root.close()
        finally:
            etcd.stop()
    for name, values in times.items():
        ms = sorted(v * 1e3 for v in values)
        print(f"{name:8s} median {statistics.median(ms):6.1f} ms   p90 {ms[int(len(ms) * 0.9) - 1]:6.1f} ms   "
              f"max {ms[-1]:6.1f} ms   ({len(ms)} launches)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the embedded etcd's authentication costs (issue 44, item 5): start-up, a client's first connection, and a
put and a get, with and without auth, interleaved so the machine's load falls on both alike.

    python tests/bench/bench_etcd_auth.py --starts 5 --ops 500

Start-up is ``EmbeddedEtcd.start()`` until a request is served (with auth: the unix-socket start that turns it on,
the stop, and the start on TCP). Open is ``open_etcd`` (with auth: etcd's Authenticate, bcrypt cost 4). Put and get
are one key, sequential, on one client.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trainwarden.agent.etcd.client import open_etcd  # noqa: E402
from trainwarden.agent.etcd.embedded import EmbeddedEtcd  # noqa: E402


def one(tmp: Path, auth: bool, ops: int) -> dict[str, float]:
    etcd = EmbeddedEtcd(data_dir=tmp / "data", log_path=tmp / "etcd.log", auth_dir=tmp / "auth" if auth else None)
    started = time.monotonic()
    etcd.start()
    out = {"start_s": time.monotonic() - started}
    try:
        began = time.monotonic()
        client = open_etcd(etcd.security.config((etcd.endpoint,)))
        out["open_ms"] = (time.monotonic() - began) * 1e3
        try:
            client.put("/bench/k", "v")
            began = time.monotonic()
            for _ in range(ops):
                client.put("/bench/k", "v")
            out["put_ms"] = (time.monotonic() - began) * 1e3 / ops
            began = time.monotonic()
            for _ in range(ops):
                client.get("/bench/k")
            out["get_ms"] = (time.monotonic() - began) * 1e3 / ops
        finally:
            client.close()
    finally:
        etcd.stop()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=5, help="starts of each kind (default 5)")
    parser.add_argument("--ops", type=int, default=500, help="puts and gets per start (default 500)")
    args = parser.parse_args()
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="bench-etcd-auth-") as tmp:
        for index in range(args.starts):
            for auth in (False, True):
                runs[auth].append(one(Path(tmp) / f"{index}-{auth}", auth, args.ops))
    for auth in (False, True):
        medians = {k: statistics.median(r[k] for r in runs[auth]) for k in runs[auth][0]}
        print(f"{'auth   ' if auth else 'no auth'}: start {medians['start_s']:.2f} s, open {medians['open_ms']:.1f} ms, "
              f"put {medians['put_ms']:.2f} ms, get {medians['get_ms']:.2f} ms (medians of {args.starts})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

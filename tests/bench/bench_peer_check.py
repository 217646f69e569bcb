"""What the kernel-verified stream identity costs (issue 30, item 3): the peer-credential token a worker fetches
before each stream, against the same stream start without it, in one process and one run.

    python tests/bench/bench_peer_check.py [--starts 40] [--fetches 2000]

A TelemetryServer (the agent's) serves a socket in this process with ``allow_unverified`` on, so both kinds of
stream are accepted. Measured, interleaved so that machine noise falls on both alike:

- one token fetch alone (connect to ``<socket>.cred``, the agent reads SO_PEERCRED and answers): median µs;
- a stream start: ``trainwarden.runtime.init`` to the agent holding the rank (its Hello accepted), verified
  (the runtime fetches a token, as always) and unverified (the fetch replaced by no token): medians and ratio.

Per step there is nothing to measure: the identity is checked at the Hello and at a Commit (once per
checkpoint), and each record's "does this stream hold the rank" was already a dictionary look-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from trainwarden.agent.telemetry.job_telemetry import JobTelemetry
from trainwarden.agent.telemetry.server import TelemetryServer
from trainwarden.runtime import agent_client
from trainwarden.runtime.session import init


def _holds(js: JobTelemetry, job: str) -> bool:
    return any(r.connected for snap in js.snapshot(job) for r in snap.ranks)


def _start(sock: Path, js: JobTelemetry, job: str) -> float:
    t0 = time.perf_counter()
    rt = init(job, env={"RANK": "0", "WORLD_SIZE": "1"}, socket_path=str(sock), flush_interval_s=0.01)
    try:
        while not _holds(js, job):
            time.sleep(0.0005)
        return time.perf_counter() - t0
    finally:
        rt.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=40, help="stream starts of each kind")
    parser.add_argument("--fetches", type=int, default=2000, help="token fetches timed alone")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tw-peer-") as tmp:
        sock = Path(tmp) / "agent.sock"
        js = JobTelemetry()
        server = TelemetryServer(sock, js, allow_unverified=True)
        server.start()
        try:
            fetch = []
            for _ in range(args.fetches):
                t0 = time.perf_counter()
                assert agent_client.fetch_peer_token(str(sock))
                fetch.append(time.perf_counter() - t0)
            real_fetch = agent_client.fetch_peer_token
            verified, unverified = [], []
            for i in range(args.starts):
                verified.append(_start(sock, js, f"v{i}"))
                agent_client.fetch_peer_token = lambda *a, **k: ""  # noqa: E731  the Hello without a token
                try:
                    unverified.append(_start(sock, js, f"u{i}"))
                finally:
                    agent_client.fetch_peer_token = real_fetch
        finally:
            server.stop()
    result = {"token_fetch_us": statistics.median(fetch) * 1e6,
              "stream_start_verified_ms": statistics.median(verified) * 1e3,
              "stream_start_unverified_ms": statistics.median(unverified) * 1e3}
    result["ratio"] = result["stream_start_verified_ms"] / result["stream_start_unverified_ms"]
    if args.json:
        print(json.dumps(result))
        return
    print(f"token fetch alone: {result['token_fetch_us']:.0f} µs (median of {args.fetches})")
    print(f"stream start, verified: {result['stream_start_verified_ms']:.2f} ms; unverified: "
          f"{result['stream_start_unverified_ms']:.2f} ms (medians of {args.starts}); ratio {result['ratio']:.2f}x")


if __name__ == "__main__":
    main()

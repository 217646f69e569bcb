"""Benchmark: what issue 44's round-2 checks cost where they run (the hang's diagnostics read, a Status call).

    python tests/bench/bench_socket_reads.py --ranks 8 --repeats 200

1. ``read_diagnostics`` of ``--ranks`` ranks (stacks of 200 threads, a Flight Recorder dump of 2,000 entries each):
   the descriptor-based, owner-checked read against the same parsing after a plain ``open`` (the old read),
   alternating in rounds; medians per read of all ranks.
2. ``fetch_status`` against an in-process ``TelemetryServer`` holding one job: a call that fetches a peer token first
   (what ``trainwarden status`` does now) against one without (before); medians per call.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from trainwarden.agent.shared import telemetry_pb2 as pb
from trainwarden.agent.shared.contract import STATUS_METHOD, stacks_file, trace_file
from trainwarden.agent.shared.peer_token import token_metadata
from trainwarden.agent.telemetry.job_telemetry import JobTelemetry, WorkerInfo
from trainwarden.agent.telemetry.server import TelemetryServer
from trainwarden.agent.watchdog.culprit import (RankEvidence, _NoGlobals, main_thread_frames, positions_from_trace,
                                                read_diagnostics)


def plant(directory: Path, ranks: int) -> None:
    for rank in range(ranks):
        threads = "".join(f"Thread 0x{t:016x} (most recent call first):\n" + "".join(
            f'  File "/job/m{f}.py", line {f} in fn{f}\n' for f in range(20)) + "\n" for t in range(200))
        (directory / stacks_file(rank)).write_text(threads)
        entries = [{"process_group": ("0", "default_pg"), "pg_id": 0, "collective_seq_id": i, "is_p2p": False,
                    "profiling_name": "nccl:all_reduce", "retired": True, "state": "completed"} for i in range(2000)]
        (directory / trace_file(rank)).write_bytes(pickle.dumps({"entries": entries}))


def old_read(directory: Path, ranks: int) -> dict:
    found = {}
    for rank in range(ranks):
        trace = _NoGlobals(io.BytesIO((directory / trace_file(rank)).read_bytes())).load()
        with open(directory / stacks_file(rank), errors="replace") as f:
            stack = main_thread_frames(f.read(4 * 1024 * 1024))
        found[rank] = RankEvidence(rank=rank, positions=positions_from_trace(trace), stack=stack, recorded=True)
    return found


def timed(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tw-bench-reads-") as tmp:
        directory = Path(tmp)
        plant(directory, args.ranks)
        assert old_read(directory, args.ranks) == read_diagnostics(directory, range(args.ranks), uid=os.geteuid())
        new_s, old_s = [], []
        for _ in range(5):
            new_s.append(timed(lambda: read_diagnostics(directory, range(args.ranks), uid=os.geteuid()),
                               args.repeats // 5))
            old_s.append(timed(lambda: old_read(directory, args.ranks), args.repeats // 5))
        new, old = statistics.median(new_s), statistics.median(old_s)
        print(f"diagnostics read of {args.ranks} ranks: checked {new * 1e3:.2f} ms, plain {old * 1e3:.2f} ms "
              f"(x{new / old:.3f})")

        js = JobTelemetry()
        js.connect(WorkerInfo(job="j", rank=0, world_size=1, pid=os.getpid(), verified=True, uid=os.geteuid()))
        srv = TelemetryServer(directory / "agent.sock", js)
        srv.start()
        try:
            sock = str(srv.socket_path)
            with grpc.insecure_channel(f"unix:{sock}") as channel:
                call = channel.unary_unary(STATUS_METHOD, request_serializer=pb.StatusRequest.SerializeToString,
                                           response_deserializer=pb.StatusReply.FromString)
                call(pb.StatusRequest(), timeout=5)
                with_token, without = [], []
                for _ in range(5):
                    with_token.append(timed(lambda: call(pb.StatusRequest(), timeout=5,
                                                         metadata=token_metadata(sock)), args.repeats // 5))
                    without.append(timed(lambda: call(pb.StatusRequest(), timeout=5), args.repeats // 5))
            w, wo = statistics.median(with_token), statistics.median(without)
            print(f"Status call: with a peer token {w * 1e3:.2f} ms, without {wo * 1e3:.2f} ms (+{(w - wo) * 1e3:.2f} ms)")
        finally:
            srv.stop(0.5)


if __name__ == "__main__":
    main()

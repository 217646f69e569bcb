"""What the listener limits of issue 44 (item 7) cost: telemetry streams and metrics scrapes, limits on vs off.

    python tests/bench/bench_listener_limits.py [--streams 200] [--records 2000] [--scrapes 300] [--rounds 3]

In one process, interleaved over rounds (modes alternate so machine noise spreads evenly):

- stream set-up: fetch a peer token, open a stream (token in the metadata), say Hello, send one step, end it; the
  median per stream over ``--streams`` sequential ones. "on": the shipped limits (Hello deadline 5 s, 64 streams
  per uid); "off": a cap as large as ``max_streams`` and a deadline of an hour (what admission then costs is
  its lock and counters alone);
- stream throughput: 8 concurrent streams each sending ``--records`` step records; records per second;
- scrape: the median of ``--scrapes`` GETs of a small registry from ``MetricsExporter`` (BoundedHTTPServer: on)
  and from prometheus_client's ``start_http_server`` (a thread per connection: off).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from trainwarden.agent.metrics.exporter import MetricsExporter
from trainwarden.agent.shared import telemetry_pb2 as pb
from trainwarden.agent.shared.contract import PEER_TOKEN_METADATA, STREAM_METHOD
from trainwarden.agent.telemetry.job_telemetry import JobTelemetry
from trainwarden.agent.telemetry.server import TelemetryServer
from trainwarden.runtime.agent_requests import fetch_peer_token

LIMITS = {"on": {}, "off": {"hello_timeout_s": 3600.0, "max_streams_per_uid": 256}}


def _stream(stub, sock: str, job: str, rank: int, world: int, records: int) -> None:
    token = fetch_peer_token(sock)
    messages = [pb.WorkerMessage(hello=pb.Hello(job=job, rank=rank, world_size=world, pid=0, peer_token=token))]
    messages += [pb.WorkerMessage(step=pb.Step(index=i, duration_seconds=0.01)) for i in range(records)]
    call = stub(iter(messages), metadata=((PEER_TOKEN_METADATA, token),), timeout=60)
    for _ in call:
        pass


def telemetry(mode: str, streams: int, records: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory(prefix="tw-bench-") as top:
        js = JobTelemetry()
        server = TelemetryServer(Path(top) / "a.sock", js, **LIMITS[mode])
        server.start()
        sock = str(server.socket_path)
        try:
            with grpc.insecure_channel(server.address) as channel:
                stub = channel.stream_stream(STREAM_METHOD, request_serializer=pb.WorkerMessage.SerializeToString,
                                             response_deserializer=pb.AgentCommand.FromString)
                setup = []
                for i in range(streams):
                    started = time.perf_counter()
                    _stream(stub, sock, f"s{i}", 0, 1, 1)
                    setup.append(time.perf_counter() - started)
                started = time.perf_counter()
                threads = [threading.Thread(target=_stream, args=(stub, sock, "t", r, 8, records)) for r in range(8)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                rate = 8 * records / (time.perf_counter() - started)
        finally:
            server.stop(0.5)
    return statistics.median(setup), rate


def scrapes(mode: str, count: int) -> float:
    registry = CollectorRegistry()
    gauge = Gauge("bench_value", "x", ["i"], registry=registry)
    for i in range(50):
        gauge.labels(str(i)).set(i)
    if mode == "on":
        exporter = MetricsExporter(registry, port=0).start()
        url, stop = exporter.url, exporter.stop
    else:
        server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"

        def stop() -> None:
            server.shutdown()
            server.server_close()
    try:
        took = []
        for _ in range(count):
            started = time.perf_counter()
            urllib.request.urlopen(url, timeout=10).read()
            took.append(time.perf_counter() - started)
        return statistics.median(took)
    finally:
        stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--scrapes", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list] = {"on": [], "off": []}
    for _ in range(args.rounds):
        for mode in ("on", "off"):
            setup, rate = telemetry(mode, args.streams, args.records)
            results[mode].append((setup, rate, scrapes(mode, args.scrapes)))
    print(f"{'limits':6} {'stream set-up ms (median)':>26} {'records/s (8 streams)':>22} {'scrape ms (median)':>19}")
    for mode, rows in results.items():
        setup = statistics.median(r[0] for r in rows) * 1e3
        rate = statistics.median(r[1] for r in rows)
        scrape = statistics.median(r[2] for r in rows) * 1e3
        print(f"{mode:6} {setup:26.2f} {rate:22.0f} {scrape:19.2f}")


if __name__ == "__main__":
    main()

"""Benchmark: a rendezvous round at the scale of real jobs (issue 28), native vs torch's dynamic rendezvous.

    python tests/bench/bench_rendezvous_scale.py --nodes 8 --nodes 64 --nodes 256 --nodes 1000 [--baseline torch]

Against a real 3-member etcd cluster that the bench starts on 127.0.0.1 (and stops, every member's process
group, however it ends), N simulated nodes run as threads of this process, sharing ``--clients`` etcd
clients (each starting on a different member and failing over to the others). For each N:

* ``close N=<n>``: from the moment all N threads are released until the last has the closed round, of
  ``agent/rendezvous/native.py`` with ``min_nodes = N/2``, ``max_nodes = N`` (it closes at max);
* ``after loss N=<n>``: every node watches the closed round; one node's lease is revoked (its key goes at
  once, as when a lease expires); from the revoke until every survivor has round + 1 closed, with N-1 members;
* the etcd operations the nodes made per phase (counted in the harness) and etcd's own counters from its
  ``/metrics`` (raft proposals committed, mvcc puts, deletes, txns), and the database size (Status: dbSize,
  dbSizeInUse) after the phase;
* the harness's own cost: ``floor N=<n>``, the same threads and clients doing one put each (no rendezvous), and
  the CPU seconds this process and the etcd members spent in each phase.

Why 64 clients by default: python3-etcd3 creates one watch at a time per client and wakes every thread
waiting to create one (``notify_all``) each time, so the harness's own CPU grows with the square of the
threads per client: 2,000 nodes on 8 clients spent 16 s of CPU in this process for an 18.5 s round, 8 s on
64 clients. A real node has a client of its own; the fewer nodes per client, the closer the figures are
to etcd's side of the work.

``--baseline torch`` also runs torch's dynamic rendezvous through the project's ``etcd3`` backend (the same
path torchrun takes: ``get_rendezvous_handler``, one client per handler) for each N up to ``--torch-max``
(default 64), with the same min:max and last call; ``--torch-cap`` (default 60 s) bounds each, as its
join timeout: a round that does not close in time is reported "not closed within 60 s".
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from _etcd_cluster import LoopbackEtcdCluster  # noqa: E402

from trainwarden.agent.rendezvous.native import NativeRendezvous, NativeRendezvousConfig  # noqa: E402

COUNTED = ("transaction", "put", "delete", "get", "get_prefix_response", "add_watch_prefix_callback",
           "cancel_watch")
METRICS = (("proposals", "etcd_server_proposals_committed_total"), ("puts", "etcd_mvcc_put_total"),
           ("deletes", "etcd_mvcc_delete_total"), ("txns", "etcd_mvcc_txn_total"))


class CountingClient:
    """An etcd client that counts the calls made through it (shared by the threads that use it)."""

    def __init__(self, client, counts: Counter, lock: threading.Lock) -> None:
        self._client, self._counts, self._lock = client, counts, lock

    def __getattr__(self, name):
        attr = getattr(self._client, name)
        if name not in COUNTED:
            return attr

        def counted(*args, **kwargs):
            with self._lock:
                self._counts[name] += 1
            return attr(*args, **kwargs)

        return counted


class Phase:
    """Wall time, this process's CPU, the etcd members' CPU and etcd's counters across one phase."""

    def __init__(self, cluster: LoopbackEtcdCluster) -> None:
        self.cluster = cluster
        self.members = [psutil.Process(pid) for pid in cluster.pids()]

    def _etcd_cpu(self) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in self.members)

    def __enter__(self) -> "Phase":
        self.metrics0 = self.cluster.metrics()
        self.cpu0, self.etcd_cpu0 = time.process_time(), self._etcd_cpu()
        return self

    def __exit__(self, *exc) -> None:
        self.cpu = time.process_time() - self.cpu0
        self.etcd_cpu = self._etcd_cpu() - self.etcd_cpu0
        time.sleep(0.5)  # the member read applies the last entries a moment after the leader commits them
        metrics = self.cluster.metrics()
        self.deltas = {label: int(metrics.get(name, 0) - self.metrics0.get(name, 0)) for label, name in METRICS}

    def describe(self) -> str:
        etcd = ", ".join(f"{k} +{v}" for k, v in self.deltas.items())
        return f"etcd {etcd}; CPU: harness {self.cpu:.1f} s, etcd members {self.etcd_cpu:.1f} s"


def db_size(cluster: LoopbackEtcdCluster, client) -> str:
    from etcd3.etcdrpc import rpc_pb2

    status = client.maintenancestub.Status(rpc_pb2.StatusRequest(), 10)
    return f"dbSize {status.dbSize / 2**20:.2f} MiB"  # python3-etcd3's proto predates dbSizeInUse


def run_threads(n: int, target, cap: float) -> tuple[float, list, list]:
    """``target(i)`` on ``n`` threads released together: (release time, each one's end time or None, results)."""
    results: list = [None] * n
    done: list = [None] * n
    start = threading.Barrier(n + 1)

    def body(i: int) -> None:
        start.wait()
        try:
            results[i] = target(i)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            results[i] = exc
        done[i] = time.monotonic()

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.monotonic()
    for t in threads:
        t.join(max(0.1, t0 + cap - time.monotonic()))
    return t0, done, results


def elapsed(t0: float, done: list) -> float:
    """Seconds from ``t0`` until the last thread ended; inf when one did not."""
    return float("inf") if any(d is None for d in done) else max(done) - t0


def bench_native(cluster, clients, n: int, cap: float, last_call: float) -> None:
    lock, counts = threading.Lock(), Counter()
    counting = [CountingClient(c, counts, lock) for c in clients]
    job = f"native-n{n}-{os.getpid()}"
    with ThreadPoolExecutor(16) as pool:
        leases = list(pool.map(lambda i: clients[i % len(clients)].lease(600), range(n)))
    config = NativeRendezvousConfig(min_nodes=max(1, n // 2), max_nodes=n, last_call_s=last_call, join_timeout_s=cap)
    nodes = [NativeRendezvous(counting[i % len(counting)], job=job, node=f"node-{i:05d}", lease=leases[i],
                              config=config) for i in range(n)]

    floor_job = f"floor-n{n}-{os.getpid()}"
    with Phase(cluster) as floor:
        t0, done, _ = run_threads(n, lambda i: counting[i % len(counting)].put(
            f"/bench/{floor_job}/{i:05d}", "x", lease=leases[i]), cap)
    floor_s = elapsed(t0, done)
    print(f"[harness] floor N={n}: {floor_s:.2f} s (one put per node on the same threads and clients, no "
          f"rendezvous); {floor.describe()}", flush=True)

    counts.clear()
    with Phase(cluster) as phase:
        t0, done, rounds = run_threads(n, lambda i: nodes[i].next_round(), cap)
    close_s = elapsed(t0, done)
    errors = [r for r in rounds if isinstance(r, BaseException)]
    if errors or close_s == float("inf"):
        print(f"[native] close N={n}: not closed within {cap:.0f} s ({len(errors)} errors, first: "
              f"{errors[0] if errors else None})", flush=True)
        return
    members = {r.members for r in rounds}
    assert len(members) == 1 and {r.number for r in rounds} == {0}, "the nodes disagree on round 0"
    assert sorted(r.rank for r in rounds) == list(range(n)), "ranks are not 0..N-1"
    ops = dict(sorted(counts.items()))
    print(f"[native] close N={n}: {close_s:.2f} s ({rounds[0].reason}); ops {ops}; {phase.describe()}; "
          f"{db_size(cluster, clients[0])}", flush=True)

    with ThreadPoolExecutor(16) as pool:
        watches = list(pool.map(lambda node: node.watch(), nodes))
    victim = n // 2
    survivors = [i for i in range(n) if i != victim]
    learned = [None] * n

    def survive(k: int):
        i = survivors[k]
        watches[i].wait(cap)
        learned[i] = time.monotonic()
        return nodes[i].next_round()

    counts.clear()
    with Phase(cluster) as phase:
        revoked_at = [None]

        def revoke():
            time.sleep(0.2)  # the survivors' threads are waiting on their watches
            revoked_at[0] = time.monotonic()
            clients[0].revoke_lease(leases[victim].id)

        killer = threading.Thread(target=revoke)
        killer.start()
        _, done, rounds = run_threads(len(survivors), survive, cap)
        killer.join()
    errors = [r for r in rounds if isinstance(r, BaseException) or r is None]
    if errors:
        print(f"[native] after loss N={n}: not closed within {cap:.0f} s ({len(errors)} errors, first: {errors[0]})",
              flush=True)
        return
    assert {r.number for r in rounds} == {1} and len({r.members for r in rounds}) == 1, "survivors disagree"
    assert rounds[0].world_size == n - 1 and f"node-{victim:05d}" not in rounds[0].members
    after_s = elapsed(revoked_at[0], done)
    last_learned = max(learned[i] for i in survivors)
    ops = dict(sorted(counts.items()))
    print(f"[native] after loss N={n}: {after_s:.2f} s (every survivor learned of the loss within "
          f"{last_learned - revoked_at[0]:.2f} s; {rounds[0].reason}); ops {ops}; {phase.describe()}; "
          f"{db_size(cluster, clients[0])}", flush=True)
    for w in watches:
        w.cancel()


def bench_torch(cluster, n: int, cap: float, last_call: float) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    params = dict(backend="etcd3", endpoint=",".join(cluster.endpoints), run_id=f"torch-n{n}-{os.getpid()}",
                  min_nodes=max(1, n // 2), max_nodes=n, local_addr="127.0.0.1", join_timeout=str(int(cap)),
                  last_call_timeout=str(int(last_call)))
    handlers = [get_rendezvous_handler(RendezvousParameters(**params)) for _ in range(n)]
    try:
        with Phase(cluster) as phase:
            t0, done, infos = run_threads(n, lambda i: handlers[i].next_rendezvous(), cap + 10)
        errors = [r for r in infos if isinstance(r, BaseException) or r is None]
        close_s = elapsed(t0, done)
        if errors or close_s > cap:
            first = next((e for e in errors if e is not None), None)
            print(f"[torch] close N={n}: not closed within {cap:.0f} s ({len(errors)} of {n} nodes without a round; "
                  f"first error: {type(first).__name__ if first else None}); {phase.describe()}", flush=True)
        else:
            assert sorted(i.rank for i in infos) == list(range(n))
            print(f"[torch] close N={n}: {close_s:.2f} s; {phase.describe()}", flush=True)
    finally:
        for h in handlers:
            try:
                h.shutdown()
            except Exception:  # noqa: BLE001 - a handler that never joined may refuse; the bench goes on
                pass


def quiet_etcd3_watch_exit(args) -> None:
    """python3-etcd3's watch thread ends every stream with ``NameError: six`` (its ``_run`` still names the
    ``six`` module it no longer imports) when a client closes; drop that one traceback, print the rest."""
    if args.exc_type is NameError and "six" in str(args.exc_value) and args.thread is not None \
            and args.thread.name.startswith("etcd3_watch_"):
        return
    sys.__excepthook__(args.exc_type, args.exc_value, args.exc_traceback)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, action="append", required=True, help="simulated nodes (repeatable)")
    p.add_argument("--baseline", choices=["torch"], help="also run torch's dynamic rendezvous (etcd3 backend)")
    p.add_argument("--torch-max", type=int, default=64, help="largest N the torch baseline runs (default 64)")
    p.add_argument("--torch-cap", type=float, default=60.0, help="seconds the torch baseline gets per N (default 60)")
    p.add_argument("--cap", type=float, default=240.0, help="seconds the native round gets per phase (default 240)")
    p.add_argument("--clients", type=int, default=64,
                   help="etcd clients the simulated nodes share (default 64; see the module docstring)")
    p.add_argument("--last-call", type=float, default=30.0,
                   help="last call in seconds, both rendezvous (default 30, torch's): the rounds measured close at "
                        "max_nodes or when the previous members are back, so it bounds only a round that goes wrong; "
                        "3 s closed a 2,000-node round early when a loaded VM spread the joins over more than that")
    args = p.parse_args()
    if any(n < 2 for n in args.nodes):
        p.error("--nodes must be at least 2 (one is lost in the second phase)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the cluster is stopped on the way out
    threading.stack_size(512 * 1024)
    threading.excepthook = quiet_etcd3_watch_exit
    with LoopbackEtcdCluster(3) as cluster:
        clients = [cluster.client(i) for i in range(args.clients)]
        print(f"etcd: 3 members on 127.0.0.1 ({', '.join(cluster.endpoints)}), {args.clients} shared clients; "
              f"{os.cpu_count()} CPUs; python {sys.version.split()[0]}", flush=True)
        try:
            for n in args.nodes:
                print(f"N={n}: load average {os.getloadavg()[0]:.1f} (other work on the machine slows every figure)",
                      flush=True)
                started = time.monotonic()
                bench_native(cluster, clients, n, args.cap, args.last_call)
                print(f"[native] N={n} took {time.monotonic() - started:.0f} s in all", flush=True)
                if args.baseline == "torch" and n <= args.torch_max:
                    started = time.monotonic()
                    bench_torch(cluster, n, args.torch_cap, args.last_call)
                    print(f"[torch] N={n} took {time.monotonic() - started:.0f} s in all", flush=True)
        finally:
            for c in clients:
                c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: the native rendezvous with one etcd client per node, as real nodes have (issue 45, item 4).

    python tests/bench/bench_rendezvous_per_node.py --nodes 128 --nodes 512 --nodes 1000 [--procs 16]

``bench_rendezvous_scale.py`` shares 64 clients among its simulated nodes (threads of one process). Here each
node is what `trainwarden run` makes on a real node: torchrun's handler for ``--rdzv-backend etcd3 --rdzv-conf
round=native`` (``create_rdzv_handler``), with its own etcd client, its own lease and the thread that keeps the
lease alive. The N handlers are spread over ``--procs`` processes (threads inside each), against a real 3-member
etcd on 127.0.0.1 that the bench starts and stops. For each N:

* ``floor``: every node's own client does one put, released together (the harness's own cost, no rendezvous);
* ``close``: from the release until the last node has round 0 (``min_nodes = N/2``, ``max_nodes = N``: it
  closes at N);
* ``idle``: 10 s of a closed round: what the N lease keep-alives cost etcd and the nodes' processes;
* ``after loss``: one node stops keeping its lease and its lease is revoked (its key goes, as when a node dies);
  every survivor asks ``num_nodes_waiting`` every 0.25 s (torchrun's monitor interval under `trainwarden run`)
  and, once it counts the loss, calls ``next_rendezvous``; from the revoke until every survivor has round 1
  with N-1 members.

Each phase also prints etcd's own counters (raft proposals, puts, txns) and the CPU seconds of the etcd members
and of the node processes. A phase that does not end within ``--cap`` seconds is reported as such and the bench
goes on to the next N. Goals (issue 45): 1,000 nodes closed within 30 s, after a loss within 10 s.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from _etcd_cluster import LoopbackEtcdCluster  # noqa: E402

MONITOR_S = 0.25
METRICS = (("proposals", "etcd_server_proposals_committed_total"), ("puts", "etcd_mvcc_put_total"),
           ("txns", "etcd_mvcc_txn_total"), ("deletes", "etcd_mvcc_delete_total"))


def _threads(items, target, cap: float) -> list:
    """``target(item)`` on a thread each, all started together: each one's (end time, result or exception)."""
    out: list = [(None, None)] * len(items)

    def body(k: int) -> None:
        try:
            out[k] = (None, target(items[k]))
        except BaseException as exc:  # noqa: BLE001 - reported by the parent
            out[k] = (None, exc)
        out[k] = (time.monotonic(), out[k][1])

    threads = [threading.Thread(target=body, args=(k,), daemon=True) for k in range(len(items))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + cap
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
    return out


def _describe(result) -> object:
    if result is None:
        return "not done within the cap"
    return f"{type(result).__name__}: {result}"[:300] if isinstance(result, BaseException) else result


def _round(result) -> object:
    """(rank, world size) of a closed round, else what went wrong."""
    return _describe(result) if result is None or isinstance(result, BaseException) else (result.rank,
                                                                                          result.world_size)


def node_process(k: int, endpoints: list[str], run_id: str, count: int, n: int, cap: float, gate, conn) -> None:
    """``count`` nodes of the job in this process; steps through the phases as the parent's ``gate`` opens."""
    import logging
    from collections import Counter

    warned: Counter = Counter()  # 1,000 nodes' lines would cost more than the rendezvous: counted, not printed

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warned[f"{record.levelname} {record.name}: {record.msg}"[:160]] += 1

    logging.basicConfig(level=logging.WARNING, handlers=[Count()])
    from concurrent.futures import ThreadPoolExecutor

    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from trainwarden.agent.rendezvous.backend import create_rdzv_handler

    threading.stack_size(512 * 1024)
    params = dict(backend="etcd3", endpoint=",".join(endpoints), run_id=run_id, min_nodes=max(1, n // 2),
                  max_nodes=n, local_addr="127.0.0.1", round="native", join_timeout=str(int(cap)),
                  last_call_timeout="30")
    with ThreadPoolExecutor(8) as pool:
        handlers = list(pool.map(lambda _: create_rdzv_handler(RendezvousParameters(**params)), range(count)))
    conn.send(("ready", [h.node for h in handlers]))

    gate.wait()  # floor
    floor = _threads(handlers, lambda h: h._client.put(f"/bench/floor/{run_id}/{h.node}", "x", lease=h._lease) is not None,
                     cap)
    conn.send(("floor", [(t, _describe(r)) for t, r in floor]))

    gate.wait()  # close
    closed = _threads(handlers, lambda h: h.next_rendezvous(), cap)
    conn.send(("close", [(t, _round(r)) for t, r in closed], dict(warned)))

    victim = conn.recv()  # after the idle phase: the node that dies, or None when it is not here
    if victim == "done":  # the parent gave up on an earlier phase
        os._exit(0)
    gate.wait()  # loss
    revoked = None
    if victim is not None:
        dead = handlers[victim]
        dead._stop.set()  # its keeper would grant a new lease at once: a dead node's does not
        revoked = time.monotonic()
        dead._client.revoke_lease(dead._lease.id)
    survivors = [h for i, h in enumerate(handlers) if i != victim]
    learned: dict[str, float] = {}

    def survive(h):
        deadline = time.monotonic() + cap
        while h.num_nodes_waiting() == 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{h.node} did not count the loss within {cap:.0f} s")
            time.sleep(MONITOR_S)
        learned[h.node] = time.monotonic()
        info = h.next_rendezvous()
        return info.rank, info.world_size

    after = _threads(survivors, survive, cap)
    conn.send(("loss", revoked, [(t, _describe(r), learned.get(h.node)) for (t, r), h in zip(after, survivors)],
               dict(warned)))
    conn.recv()  # done: the parent stops etcd after every process has left
    sys.stdout.flush()
    os._exit(0)  # 60 handlers' clients and threads: nothing to finalise, the cluster goes next


class Meter:
    """etcd's counters and the CPU of the etcd members and the node processes across one phase."""

    def __init__(self, cluster: LoopbackEtcdCluster, procs: list[psutil.Process]) -> None:
        self.cluster, self.procs = cluster, procs
        self.members = [psutil.Process(pid) for pid in cluster.pids()]

    @staticmethod
    def _cpu(procs) -> float:
        total = 0.0
        for p in procs:
            try:
                total += sum(p.cpu_times()[:2])
            except psutil.NoSuchProcess:
                pass
        return total

    def __enter__(self) -> "Meter":
        self.m0, self.etcd0, self.nodes0 = self.cluster.metrics(), self._cpu(self.members), self._cpu(self.procs)
        return self

    def __exit__(self, *exc) -> None:
        self.etcd_cpu, self.nodes_cpu = self._cpu(self.members) - self.etcd0, self._cpu(self.procs) - self.nodes0
        time.sleep(0.5)  # the member read applies the last entries a moment after the leader commits them
        m1 = self.cluster.metrics()
        self.deltas = {label: int(m1.get(name, 0) - self.m0.get(name, 0)) for label, name in METRICS}

    def describe(self) -> str:
        etcd = ", ".join(f"{k} +{v}" for k, v in self.deltas.items())
        return f"etcd {etcd}; CPU: etcd members {self.etcd_cpu:.1f} s, node processes {self.nodes_cpu:.1f} s"


def _gather(conns, tag: str, cap: float) -> list:
    out = []
    for conn in conns:
        if not conn.poll(cap):
            raise TimeoutError(f"a node process sent no {tag!r} within {cap:.0f} s")
        got = conn.recv()
        if got[0] != tag:
            raise RuntimeError(f"a node process sent {got[0]!r}, expected {tag!r}")
        out.append(got[1:])
    return out


def _merge(counts) -> dict:
    total: dict = {}
    for c in counts:
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    return total


def _print_warned(warned: dict, since: dict | None = None) -> None:
    """The nodes' log lines at warning and above, counted by their message (only those new ``since``)."""
    for line, count in sorted(warned.items(), key=lambda kv: -kv[1]):
        more = count - (since or {}).get(line, 0)
        if more:
            print(f"    {more} x {line}", flush=True)


def _span(t0: float, ends: list) -> str:
    failed = [r for t, r in ends if t is None or isinstance(r, str)]
    if failed:
        return f"not done within the cap ({len(failed)} of {len(ends)} nodes; first: {failed[0]})"
    return f"{max(t for t, _ in ends) - t0:.2f} s"


def bench(cluster: LoopbackEtcdCluster, n: int, procs_n: int, cap: float) -> None:
    ctx = mp.get_context("spawn")  # never fork a process that holds gRPC's threads
    run_id = f"pernode-n{n}-{os.getpid()}"
    sizes = [n // procs_n + (1 if k < n % procs_n else 0) for k in range(procs_n)]
    sizes = [s for s in sizes if s]
    gate = ctx.Barrier(len(sizes) + 1)
    pipes = [ctx.Pipe() for _ in sizes]
    procs = [ctx.Process(target=node_process, args=(k, cluster.endpoints, run_id, size, n, cap, gate, child),
                         daemon=True) for k, (size, (_, child)) in enumerate(zip(sizes, pipes))]
    conns = [parent for parent, _ in pipes]
    started = time.monotonic()
    for p in procs:
        p.start()
    try:
        _gather(conns, "ready", cap + 120)
        ps = [psutil.Process(p.pid) for p in procs]
        print(f"  {n} handlers (own client, lease and keeper each) in {len(ps)} processes, made in "
              f"{time.monotonic() - started:.1f} s", flush=True)

        with Meter(cluster, ps) as meter:
            gate.wait()
            t0 = time.monotonic()
            ends = [e for (got,) in _gather(conns, "floor", cap + 30) for e in got]
        print(f"[harness] floor N={n}: {_span(t0, ends)} (one put per node on its own client); {meter.describe()}",
              flush=True)

        with Meter(cluster, ps) as meter:
            gate.wait()
            t0 = time.monotonic()
            got = _gather(conns, "close", cap + 30)
        ends = [e for ends_, _ in got for e in ends_]
        warned = _merge(w for _, w in got)
        ranks = sorted(r[0] for _, r in ends if isinstance(r, tuple))
        print(f"[per-node] close N={n}: {_span(t0, ends)}; ranks 0..{n - 1} each once: {ranks == list(range(n))}; "
              f"{meter.describe()}", flush=True)
        _print_warned(warned)
        if ranks != list(range(n)):
            return

        with Meter(cluster, ps) as meter:
            time.sleep(10)
        print(f"[per-node] idle N={n}: 10 s of a closed round (the keep-alives); {meter.describe()}", flush=True)

        victim_proc = len(conns) // 2
        for k, conn in enumerate(conns):
            conn.send(0 if k == victim_proc else None)
        with Meter(cluster, ps) as meter:
            gate.wait()
            results = _gather(conns, "loss", cap + 30)
        revoked = next(r for r, _, _ in results if r is not None)
        ends = [(t, r) for _, got, _ in results for t, r, _ in got]
        learned = [seen for _, got, _ in results for _, _, seen in got]
        worlds = {r[1] for _, r in ends if isinstance(r, tuple)}
        heard = (f"every survivor counted the loss within {max(learned) - revoked:.2f} s"
                 if all(s is not None for s in learned) else "not every survivor counted the loss")
        print(f"[per-node] after loss N={n}: {_span(revoked, ends)} ({heard}; world sizes {sorted(worlds)}); "
              f"{meter.describe()}", flush=True)
        _print_warned(_merge(w for _, _, w in results), since=warned)
    finally:
        for conn in conns:
            try:
                conn.send("done")
            except (BrokenPipeError, OSError):
                pass
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, action="append", required=True, help="simulated nodes (repeatable)")
    p.add_argument("--procs", type=int, default=16, help="processes the nodes are spread over (default 16)")
    p.add_argument("--cap", type=float, default=240.0, help="seconds each phase gets (default 240)")
    args = p.parse_args()
    if any(n < 2 for n in args.nodes):
        p.error("--nodes must be at least 2 (one is lost in the last phase)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the cluster and the node processes are stopped
    with LoopbackEtcdCluster(3) as cluster:
        print(f"etcd: 3 members on 127.0.0.1 ({', '.join(cluster.endpoints)}); {os.cpu_count()} CPUs; python "
              f"{sys.version.split()[0]}", flush=True)
        for n in args.nodes:
            print(f"N={n}: load average {os.getloadavg()[0]:.1f} (other work on the machine slows every figure)",
                  flush=True)
            started = time.monotonic()
            bench(cluster, n, min(args.procs, n), args.cap)
            print(f"[per-node] N={n} took {time.monotonic() - started:.0f} s in all", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

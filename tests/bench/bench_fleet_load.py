"""Benchmark: the fleet's steady etcd load (issue 28), N nodes training one job, nothing failing.

    python tests/bench/bench_fleet_load.py --nodes 1000 --nodes 4000 [--seconds 60] [--mode both]

Against a 3-member etcd on 127.0.0.1 (tests/bench/_etcd_cluster.py, with the project's auto-compaction settings),
N simulated nodes make exactly the periodic etcd requests one node makes in steady state: its daemon
(agent/node/job_runner.py), its launcher (the membership's keep-alive, progress, goodput, node-loss and leave
protocols) and its torchrun's native rendezvous handler (agent/rendezvous/native_handler.py). Keys come from the
code's own key functions and the periods from its constants; nothing is copied but what the old code did
(``--mode poll``: the polling of main before issue 28, ``OLD`` below, with the numbers it had).

The nodes are simulated by ``--procs`` processes (asyncio and gRPC's aio client, ``--channels`` connections each,
spread over the three members); each schedules every node's requests on their periods (random phases) and counts
what it intended and what it achieved, and how late requests started. Each python3-etcd3 lease refresh opens a
keep-alive stream of its own; the harness does too with ``--keepalive per-call``, and by default sends the keep-alives
on one stream per connection, which leaves it CPU for the rest on a 2-core machine (etcd's work per keep-alive is
the same; the stream's setup is not counted). Leases are granted with a long TTL so that a harness that
falls behind measures less load rather than expiring keys; the keep-alive periods are the real ones.

Printed per mode and N: requests a second by kind (intended, achieved), writes a second as etcd counted them (mvcc
puts), reads a second (mvcc ranges, all members), watches open (etcd's watcher gauge), the CPU seconds a second of
the three etcd processes (psutil) and of the harness, the database before and after the run and after a
compaction at the run's last revision (what ``--auto-compaction-*`` does at its next period), and the ratio of
poll to watch. The machine's load average is printed with each run.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import inspect
import json
import multiprocessing as mp
import os
import random
import re
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from _etcd_cluster import LoopbackEtcdCluster  # noqa: E402

from trainwarden.agent.common.job_spec import parse_job_spec  # noqa: E402
from trainwarden.agent.etcd.cluster import LEAVE_REREAD_S, PROGRESS_PERIOD_S  # noqa: E402
from trainwarden.agent.etcd.embedded import AUTO_COMPACTION_ARGS  # noqa: E402
from trainwarden.agent.etcd.jobs import JobControl  # noqa: E402
from trainwarden.agent.etcd.keys import job_key, rendezvous_key  # noqa: E402
from trainwarden.agent.etcd.membership import MEMBERSHIP_TTL_S, nodes_prefix  # noqa: E402
from trainwarden.agent.incidents import node_loss  # noqa: E402
from trainwarden.agent.launch.goodput import GoodputLedger  # noqa: E402
from trainwarden.agent.launch.goodput_store import GOODPUT_PERIOD_S, goodput_key  # noqa: E402
from trainwarden.agent.launch.run import MULTI_NODE_RDZV, RunOptions  # noqa: E402
from trainwarden.agent.node import job_runner  # noqa: E402
from trainwarden.agent.rendezvous import native_handler  # noqa: E402

JOB, RANKS_PER_NODE, LONG_TTL = "fleet", 8, 3600

DAEMON_INTERVAL_S = inspect.signature(job_runner.JobRunner.__init__).parameters["interval_s"].default
MEMBERSHIP_PERIOD_S = max(0.5, MEMBERSHIP_TTL_S / 3)  # NodeMembership.period
RDZV_TTL_S = int(MULTI_NODE_RDZV["keep_alive_interval"]) * int(MULTI_NODE_RDZV["keep_alive_max_attempt"])
RDZV_KEEPALIVE_S = max(0.5, RDZV_TTL_S / 3)  # NativeRendezvousHandler._keep_alive
MONITOR_S = RunOptions.monitor_interval  # torchrun's agent calls num_nodes_waiting every monitor interval
LOSS_CHECK_S = inspect.signature(node_loss.NodeLossWatcher.__init__).parameters["period_s"].default

OLD = {"progress_s": 3.0, "leave_poll_s": 1.0}
"""What main did before issue 28 that no constant says any more: progress every 3 s; the leave protocol read
``leave/<round>`` and ``exclude/<node>`` every second. (The daemon's 2 s round and the node-loss watcher's 1 s
period are still the code's defaults, now for local checks.)"""


def schedule(mode: str) -> dict[str, tuple[float, list[str]]]:
    """Per node: name -> (period in seconds, the requests of one occurrence)."""
    if mode == "watch":
        keepalive = -(-job_runner.NODE_RECORD_KEEPALIVE_S // DAEMON_INTERVAL_S) * DAEMON_INTERVAL_S  # on a round
        return {
            "daemon node-record keep-alive": (keepalive, ["keepalive"]),
            "daemon safety re-read": (job_runner.SAFETY_REREAD_S, [
                "index", "get spec", "get state", "get control", "get cordon", "rewatch index", "rewatch cordon",
                "rewatch state"]),
            "membership keep-alive": (MEMBERSHIP_PERIOD_S, ["keepalive"]),
            "progress": (PROGRESS_PERIOD_S, ["keepalive", "put progress"]),
            "goodput": (GOODPUT_PERIOD_S, ["put goodput"]),
            "node-loss count": (node_loss.SAFETY_REREAD_S, ["count members"]),
            "leave re-read": (LEAVE_REREAD_S, ["range leave", "get exclude", "rewatch leave", "rewatch exclude"]),
            "rdzv lease keep-alive": (RDZV_KEEPALIVE_S, ["keepalive"]),
            "rdzv waiting count": (native_handler.WAITING_POLL_S, ["count next round"]),
            "rdzv round count": (native_handler.RECOUNT_S, ["count round"]),
        }
    return {
        "daemon round": (DAEMON_INTERVAL_S, ["jobs keys", "get spec", "get state", "get control", "get checkpoint",
                                              "range members", "get cordon", "keepalive", "put node"]),
        "membership keep-alive": (MEMBERSHIP_PERIOD_S, ["keepalive"]),
        "progress": (OLD["progress_s"], ["keepalive", "put progress"]),
        "goodput": (GOODPUT_PERIOD_S, ["put goodput"]),
        "node-loss read": (LOSS_CHECK_S, ["range members"]),
        "leave poll": (OLD["leave_poll_s"], ["get leave", "get exclude"]),
        "rdzv lease keep-alive": (RDZV_KEEPALIVE_S, ["keepalive"]),
        "rdzv num_nodes_waiting": (MONITOR_S, ["count next round", "count round"]),
    }


WATCHES = {"watch": ["index", "cordon", "state", "members", "leave", "exclude", "round"], "poll": ["round"]}
"""The watches one node holds: the daemon's three, the launcher's three, the rendezvous handler's one."""


def node_name(i: int) -> str:
    return f"node{i:05d}"


# ---- one harness process ---------------------------------------------------------------------------------


class Node:
    def __init__(self, i: int) -> None:
        self.name = node_name(i)
        self.leases: dict[str, int] = {}
        self.watch_ids: dict[str, tuple[int, int]] = {}  # what -> (stream, watch id)


class Harness:
    def __init__(self, endpoints: list[str], nodes: list[int], mode: str, channels: int,
                 shared_keepalive: bool) -> None:
        import grpc
        from etcd3.etcdrpc import rpc_pb2, rpc_pb2_grpc

        self.pb, self.mode = rpc_pb2, mode
        self.channels = [grpc.aio.insecure_channel(endpoints[c % len(endpoints)]) for c in range(channels)]
        self.kv = [rpc_pb2_grpc.KVStub(ch) for ch in self.channels]
        self.lease = [rpc_pb2_grpc.LeaseStub(ch) for ch in self.channels]
        self.watchers = [rpc_pb2_grpc.WatchStub(ch) for ch in self.channels]
        self.nodes = [Node(i) for i in nodes]
        self.intended, self.achieved, self.errors, self.backlog = Counter(), Counter(), Counter(), Counter()
        self.late: list[float] = []
        self.events = 0
        self.streams: list = []
        self.pending: list[list[asyncio.Future]] = []
        self.writing: list[asyncio.Lock] = []  # one write at a time on a gRPC aio stream
        self.shared_keepalive = shared_keepalive
        self.ka_streams: list = []
        self.ka_pending: list[list[asyncio.Future]] = []
        self.ka_writing: list[asyncio.Lock] = []
        self.values = self._values()

    def _values(self) -> dict[str, bytes]:
        ledger = GoodputLedger(JOB, launched_at=time.time() - 3600, node="node")
        progress = {"node": "node", "at": time.time(), "ranks": {
            str(r): {"last_step": 123456, "connected": True} for r in range(RANKS_PER_NODE)}}
        record = {"node": "node", "host": "host-0000.cluster.example", "address": "10.0.0.1", "version": "0.0.0",
                  "pid": 12345, "at": time.time(), "gpus": 8, "health": "ok", "endpoints": {"metrics": "x:9478"},
                  "jobs": {JOB: {"pid": 23456, "generation": 1}}}
        return {"progress": json.dumps(progress, sort_keys=True).encode(),
                "goodput": json.dumps(ledger.state(), sort_keys=True).encode(),
                "node": json.dumps(record, sort_keys=True).encode()}

    def _c(self, node: Node) -> int:
        return hash(node.name) % len(self.channels)

    # -- setup: this slice's keys and leases ------------------------------------------------------------

    async def setup(self) -> None:
        sem = asyncio.Semaphore(64)

        async def one(node: Node) -> None:
            async with sem:
                c = self._c(node)
                for what in ("node", "membership", "progress", "rdzv"):
                    r = await self.lease[c].LeaseGrant(self.pb.LeaseGrantRequest(TTL=LONG_TTL))
                    node.leases[what] = r.ID
                puts = [(self._key(node, "node"), self.values["node"], node.leases["node"]),
                        (self._key(node, "members"), b'{"owner": {}, "ranks": [0]}', node.leases["membership"]),
                        (self._key(node, "progress"), self.values["progress"], node.leases["progress"]),
                        (self._key(node, "goodput"), self.values["goodput"], 0),
                        (self._key(node, "round"), b'{"node": "x"}', node.leases["rdzv"])]
                for key, value, lease in puts:
                    await self.kv[c].Put(self.pb.PutRequest(key=key.encode(), value=value, lease=lease))

        await asyncio.gather(*(one(n) for n in self.nodes))
        for c, stub in enumerate(self.watchers):
            call = stub.Watch()
            self.streams.append(call)
            self.pending.append([])
            self.writing.append(asyncio.Lock())
            asyncio.get_running_loop().create_task(self._read_watch(c, call))
            if self.shared_keepalive:
                ka = self.lease[c].LeaseKeepAlive()
                self.ka_streams.append(ka)
                self.ka_pending.append([])
                self.ka_writing.append(asyncio.Lock())
                asyncio.get_running_loop().create_task(self._read_keepalives(c, ka))
        for node in self.nodes:
            for what in WATCHES[self.mode]:
                await self._watch(node, what)

    def _key(self, node: Node, what: str) -> str:
        control = JobControl(None)
        return {"node": control.node_key(node.name), "cordon": control.node_key(node.name, "cordon"),
                "members": nodes_prefix(JOB) + node.name, "progress": job_key(JOB, "progress", node.name),
                "goodput": goodput_key(JOB, node.name), "round": rendezvous_key(JOB, 0, "nodes", node.name),
                "exclude": job_key(JOB, "exclude", node.name)}[what]

    def _range(self, what: str, node: Node):
        """(key, range_end or None) of a watch or a read."""
        from etcd3.utils import prefix_range_end

        def prefix(p: str):
            return p.encode(), prefix_range_end(p.encode())

        control = JobControl(None)
        return {"index": prefix(control.index_key()), "cordon": (self._key(node, "cordon").encode(), None),
                "state": (job_key(JOB, "state").encode(), None), "members": prefix(nodes_prefix(JOB)),
                "leave": prefix(job_key(JOB, "leave", "")), "exclude": (self._key(node, "exclude").encode(), None),
                "round": prefix(rendezvous_key(JOB, 0, "nodes") + "/"),
                "next round": prefix(rendezvous_key(JOB, 1, "nodes") + "/"),
                "jobs": prefix(job_key("", "")[:-1])}[what]

    async def _read_watch(self, c: int, call) -> None:
        try:
            async for response in call:
                if response.created and self.pending[c]:
                    self.pending[c].pop(0).set_result(response.watch_id)
                self.events += len(response.events)
        except Exception:  # noqa: BLE001 - the stream ends with the run
            pass

    async def _read_keepalives(self, c: int, call) -> None:
        try:
            async for _ in call:
                if self.ka_pending[c]:
                    self.ka_pending[c].pop(0).set_result(None)
        except Exception:  # noqa: BLE001 - the stream ends with the run
            pass

    async def _watch(self, node: Node, what: str) -> None:
        c = self._c(node)
        key, end = self._range(what, node)
        future = asyncio.get_running_loop().create_future()
        create = self.pb.WatchCreateRequest(key=key, range_end=end or b"")
        async with self.writing[c]:  # etcd answers a stream's creates in order: the FIFO matches them
            self.pending[c].append(future)
            await self.streams[c].write(self.pb.WatchRequest(create_request=create))
        node.watch_ids[what] = (c, await future)

    async def _unwatch(self, node: Node, what: str) -> None:
        c, watch_id = node.watch_ids.pop(what)
        async with self.writing[c]:
            await self.streams[c].write(self.pb.WatchRequest(
                cancel_request=self.pb.WatchCancelRequest(watch_id=watch_id)))

    # -- the steady state -------------------------------------------------------------------------------

    async def request(self, node: Node, op: str, lease: str) -> None:
        pb, c = self.pb, self._c(node)
        kv = self.kv[c]
        if op == "keepalive" and self.shared_keepalive:
            future = asyncio.get_running_loop().create_future()
            async with self.ka_writing[c]:  # etcd answers a stream's keep-alives in order
                self.ka_pending[c].append(future)
                await self.ka_streams[c].write(pb.LeaseKeepAliveRequest(ID=node.leases[lease]))
            await future
        elif op == "keepalive":
            call = self.lease[c].LeaseKeepAlive()  # python3-etcd3's refresh_lease: one stream per refresh
            await call.write(pb.LeaseKeepAliveRequest(ID=node.leases[lease]))
            await call.read()
            await call.done_writing()
            call.cancel()
        elif op.startswith("put "):
            what = op[4:]
            key = self._key(node, what)
            lease_id = node.leases.get({"progress": "progress", "node": "node"}.get(what, ""), 0)
            await kv.Put(pb.PutRequest(key=key.encode(), value=self.values[what], lease=lease_id))
        elif op.startswith("rewatch "):
            what = op[8:]
            await self._unwatch(node, what)
            await self._watch(node, what)
        elif op.startswith("get "):
            what = op[4:]
            key = {"spec": job_key(JOB, "spec"), "state": job_key(JOB, "state"),
                   "control": job_key(JOB, "control"), "checkpoint": job_key(JOB, "checkpoint"),
                   "cordon": self._key(node, "cordon"), "exclude": self._key(node, "exclude"),
                   "leave": job_key(JOB, "leave", "00000001.00000000")}[what]
            await kv.Range(pb.RangeRequest(key=key.encode()))
        else:
            what, options = {"index": ("index", {"keys_only": True}), "jobs keys": ("jobs", {"keys_only": True}),
                             "range members": ("members", {}), "range leave": ("leave", {}),
                             "count members": ("members", {"count_only": True}),
                             "count round": ("round", {"count_only": True}),
                             "count next round": ("next round", {"count_only": True})}[op]
            key, end = self._range(what, node)
            await kv.Range(pb.RangeRequest(key=key, range_end=end, **options))

    async def run(self, seconds: float, concurrency: int) -> None:
        plan = schedule(self.mode)
        lease_of = {"daemon node-record keep-alive": "node", "daemon round": "node", "membership keep-alive":
                    "membership", "progress": "progress", "rdzv lease keep-alive": "rdzv"}
        start = time.monotonic()
        end = start + seconds
        heap = [(start + random.uniform(0, period), k, name, i)
                for i, node in enumerate(self.nodes) for k, (name, (period, _)) in enumerate(plan.items())]
        heapq.heapify(heap)
        for due, _, name, _ in heap:  # intended: every occurrence due within the run
            period, ops = plan[name]
            n = int((end - due) // period) + 1 if due < end else 0
            for op in ops:
                self.intended[op] += n
        sem = asyncio.Semaphore(concurrency)
        tasks: set[asyncio.Task] = set()

        async def occurrence(node: Node, name: str, ops: list[str]) -> None:
            async with sem:
                for op in ops:
                    try:
                        await self.request(node, op, lease_of.get(name, ""))
                        if time.monotonic() < end:  # what etcd served within the window
                            self.achieved[op] += 1
                        else:
                            self.backlog[op] += 1
                    except Exception as exc:  # noqa: BLE001 - counted and printed
                        self.errors[f"{op}: {type(exc).__name__}"] += 1

        while heap and heap[0][0] < end:
            due, k, name, i = heapq.heappop(heap)
            now = time.monotonic()
            if due > now:
                await asyncio.sleep(due - now)
            self.late.append(max(0.0, time.monotonic() - due))
            task = asyncio.get_running_loop().create_task(occurrence(self.nodes[i], name, plan[name][1]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            heapq.heappush(heap, (due + plan[name][0], k, name, i))
        if tasks:
            await asyncio.wait(tasks, timeout=30)

    async def close(self) -> None:
        for call in self.streams + self.ka_streams:
            call.cancel()
        for ch in self.channels:
            await ch.close()


def worker(endpoints, nodes, mode, channels, concurrency, seconds, shared, ready, go, results) -> None:
    async def main() -> None:
        harness = Harness(endpoints, nodes, mode, channels, shared)
        await harness.setup()
        ready.put(os.getpid())
        while not go.is_set():
            await asyncio.sleep(0.05)
        harness.events = 0  # the other processes' setup writes reached these watches too
        cpu0 = time.process_time()
        await harness.run(seconds, concurrency)
        cpu = time.process_time() - cpu0
        late = sorted(harness.late) or [0.0]
        results.put({"intended": dict(harness.intended), "achieved": dict(harness.achieved),
                     "backlog": dict(harness.backlog),
                     "errors": dict(harness.errors), "cpu": cpu, "events": harness.events,
                     "late_p50": late[len(late) // 2], "late_p99": late[int(len(late) * 0.99)]})
        await harness.close()

    asyncio.run(main())


# ---- the parent: etcd, the processes, the numbers --------------------------------------------------------

GRPC = re.compile(r'^grpc_server_handled_total\{[^}]*grpc_method="(\w+)"[^}]*\} ([0-9.e+]+)$', re.M)


def member_text(cluster: LoopbackEtcdCluster, member: int) -> str:
    port = cluster.client_ports[cluster.names[member]]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def snapshot(cluster: LoopbackEtcdCluster) -> dict:
    out = {"cpu": sum(sum(psutil.Process(p).cpu_times()[:2]) for p in cluster.pids()), "methods": Counter()}
    for m in range(len(cluster.names)):
        metrics = cluster.metrics(m)
        out[f"m{m}"] = metrics
        for method, value in GRPC.findall(member_text(cluster, m)):
            out["methods"][method] += float(value)
    return out


def db(cluster: LoopbackEtcdCluster) -> tuple[float, float]:
    """(total, in use) of member 0's database, MiB."""
    metrics = cluster.metrics(0)
    return (metrics.get("etcd_mvcc_db_total_size_in_bytes", 0) / 2**20,
            metrics.get("etcd_mvcc_db_total_size_in_use_in_bytes", 0) / 2**20)


def compact(cluster: LoopbackEtcdCluster) -> None:
    client = cluster.client(0)
    try:
        _, meta = client.get("/bench/_probe")
        client.put("/bench/_probe", "2")
        _, meta = client.get("/bench/_probe")
        client.compact(meta.mod_revision, physical=True)
    finally:
        client.close()


def run_one(args, n: int, mode: str) -> dict:
    with LoopbackEtcdCluster(extra_args=AUTO_COMPACTION_ARGS) as cluster:
        client = cluster.client(0)
        try:  # the job, as `trainwarden submit` writes it, running
            control = JobControl(client)
            control.submit(parse_job_spec({"name": JOB, "command": ["train.py"], "nnodes": f"1:{n}"}, "bench"))
            state = {"job": JOB, "phase": "running", "generation": 1, "restarts": 0, "owner": {}}
            client.put(job_key(JOB, "state"), json.dumps(state))
        finally:
            client.close()
        procs = max(1, min(args.procs, n))
        slices = [list(range(n))[p::procs] for p in range(procs)]
        ctx = mp.get_context("spawn")
        ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
        workers = [ctx.Process(target=worker, args=(cluster.endpoints, s, mode, args.channels, args.concurrency,
                                                    args.seconds, args.keepalive == "shared", ready, go, results), daemon=True) for s in slices]
        try:
            t0 = time.monotonic()
            for w in workers:
                w.start()
            pids = [ready.get(timeout=600) for _ in workers]
            setup_s = time.monotonic() - t0
            time.sleep(2.0)  # let the setup's writes settle
            db_before = db(cluster)
            before = snapshot(cluster)
            load0 = os.getloadavg()
            start = time.monotonic()
            go.set()
            time.sleep(args.seconds / 2)
            watchers = sum(cluster.metrics(m).get("etcd_debugging_mvcc_watcher_total", 0) for m in range(3))
            rest = args.seconds - (time.monotonic() - start)
            time.sleep(max(0.0, rest))
            after = snapshot(cluster)  # the window's end: the etcd counters and CPU of the planned seconds
            wall = time.monotonic() - start
            outs = [results.get(timeout=args.seconds + 120) for _ in workers]
            load1 = os.getloadavg()
            db_after = db(cluster)
            compact(cluster)
            time.sleep(1.0)
            db_compacted = db(cluster)
        finally:
            for w in workers:
                w.join(30)
                if w.is_alive():
                    w.kill()
        del pids
    total = {k: Counter() for k in ("intended", "achieved", "errors", "backlog")}
    for o in outs:
        for k in total:
            total[k].update(o[k])
    m0b, m0a = before["m0"], after["m0"]
    ranges = sum(after[f"m{m}"].get("etcd_mvcc_range_total", 0) - before[f"m{m}"].get("etcd_mvcc_range_total", 0)
                 for m in range(3))
    methods = {k: after["methods"][k] - before["methods"][k] for k in after["methods"]}
    return {"n": n, "mode": mode, "wall": wall, "setup_s": setup_s, "load": (load0, load1), **total,
            "harness_cpu": sum(o["cpu"] for o in outs), "events": sum(o["events"] for o in outs),
            "late_p50": max(o["late_p50"] for o in outs), "late_p99": max(o["late_p99"] for o in outs),
            "etcd_cpu": after["cpu"] - before["cpu"],
            "puts": m0a.get("etcd_mvcc_put_total", 0) - m0b.get("etcd_mvcc_put_total", 0),
            "ranges": ranges, "methods": methods,
            "watchers": watchers,
            "db": (db_before, db_after, db_compacted)}


def report(r: dict) -> None:
    w = r["wall"]
    intended, achieved = sum(r["intended"].values()), sum(r["achieved"].values())
    print(f"\n== {r['mode']} N={r['n']}: {w:.0f} s (setup {r['setup_s']:.0f} s), load average "
          f"{r['load'][0][0]:.1f} -> {r['load'][1][0]:.1f}; {sum(r['backlog'].values()):,} requests completed "
          f"after the window (the harness's backlog)")
    print(f"  requests/s intended {intended / w:,.0f}, achieved {achieved / w:,.0f} "
          f"({100 * achieved / max(intended, 1):.0f} %); start lateness p50 {r['late_p50']:.2f} s, "
          f"p99 {r['late_p99']:.2f} s; harness CPU {r['harness_cpu'] / w:.2f} s/s")
    for op in sorted(r["intended"]):
        print(f"    {op:<18} intended {r['intended'][op] / w:>9,.1f}/s  achieved {r['achieved'].get(op, 0) / w:>9,.1f}/s")
    if r["errors"]:
        print(f"  errors: {dict(r['errors'])}")
    handled = {k: v / w for k, v in sorted(r["methods"].items()) if v}
    print(f"  etcd: writes (mvcc puts) {r['puts'] / w:,.0f}/s, reads (mvcc ranges, 3 members) {r['ranges'] / w:,.0f}/s, "
          f"watches {r['watchers']:,.0f}, watch events delivered {r['events'] / w:,.0f}/s")
    print("  etcd gRPC calls/s by method: " + ", ".join(f"{k} {v:,.0f}" for k, v in handled.items()))
    print(f"  etcd CPU {r['etcd_cpu'] / w:.2f} s/s (3 members), {1000 * r['etcd_cpu'] / max(achieved, 1):.2f} ms per "
          "achieved request")
    (b_total, b_use), (a_total, a_use), (c_total, c_use) = r["db"]
    print(f"  database (member 0): before {b_total:.1f} MiB ({b_use:.1f} in use), after {a_total:.1f} MiB "
          f"({a_use:.1f} in use, +{(a_use - b_use) / w * 3600:,.0f} MiB/h uncompacted), after compaction "
          f"{c_total:.1f} MiB ({c_use:.1f} in use)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, action="append", help="simulated nodes (repeatable; 1000 and 4000)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--mode", choices=("watch", "poll", "both"), default="both")
    parser.add_argument("--procs", type=int, default=2, help="harness processes")
    parser.add_argument("--channels", type=int, default=24, help="gRPC connections per harness process")
    parser.add_argument("--concurrency", type=int, default=512, help="requests in flight per harness process")
    parser.add_argument("--keepalive", choices=("shared", "per-call"), default="shared",
                        help="lease keep-alives on one stream per connection (cheap for the harness), or a stream "
                             "per keep-alive as python3-etcd3's refresh_lease does (what the nodes do; costs the "
                             "harness and etcd more)")
    args = parser.parse_args()
    modes = ("watch", "poll") if args.mode == "both" else (args.mode,)
    print(f"bench_fleet_load: nodes {args.nodes or [1000, 4000]}, {args.seconds:.0f} s each, modes {modes}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; per node (watch): "
          + ", ".join(f"{k} every {p:g} s" for k, (p, _) in schedule("watch").items()))
    results = {}
    for n in args.nodes or [1000, 4000]:
        for mode in modes:
            results[(n, mode)] = r = run_one(args, n, mode)
            report(r)
        if len(modes) == 2:
            watch, poll = results[(n, "watch")], results[(n, "poll")]
            ratio = lambda k: poll[k] / max(watch[k], 1e-9)  # noqa: E731
            print(f"\n  N={n} poll / watch: intended requests {sum(poll['intended'].values()) / max(sum(watch['intended'].values()), 1):.1f}x, "
                  f"achieved {sum(poll['achieved'].values()) / max(sum(watch['achieved'].values()), 1):.1f}x, "
                  f"etcd CPU {ratio('etcd_cpu'):.1f}x, writes {ratio('puts'):.1f}x, reads {ratio('ranges'):.1f}x "
                  "(achieved figures are the harness's, which polling's large reads hold back)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The native rendezvous (agent/rendezvous/native.py) against a real etcd on loopback, 16 simulated nodes.

Each node is a thread with a lease of its own, sharing a few clients, as in tests/bench/bench_rendezvous_scale.py.
No wall-clock thresholds: each test waits for an outcome within a generous bound and checks what it was.
"""

from __future__ import annotations

import json
import threading

import pytest

from trainwarden.agent.etcd.client import open_client
from trainwarden.agent.etcd.embedded import EmbeddedEtcd
from trainwarden.agent.etcd.keys import rendezvous_key
from trainwarden.agent.rendezvous.native import (NativeRendezvous, NativeRendezvousConfig,
                                                 NativeRendezvousUnavailable)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

N = 16


@pytest.fixture(scope="module")
def etcd(module_etcd):
    return module_etcd


@pytest.fixture
def clients(etcd):
    opened = [open_client("127.0.0.1", etcd.client_port, timeout=10.0) for _ in range(4)]
    try:
        yield opened
    finally:
        for c in opened:
            c.close()


@pytest.fixture
def job(request) -> str:
    return request.node.name.replace("_", "-")[:60]


def _nodes(clients, job, n, *, first=0, min_nodes=None, max_nodes=None, last_call_s=30.0):
    config = NativeRendezvousConfig(min_nodes=min_nodes or n, max_nodes=max_nodes or n, last_call_s=last_call_s,
                                    join_timeout_s=40.0)
    leases = {}
    nodes = []
    for i in range(first, first + n):
        client = clients[i % len(clients)]
        leases[f"node-{i:02d}"] = client.lease(60)
        nodes.append(NativeRendezvous(client, job=job, node=f"node-{i:02d}", lease=leases[f"node-{i:02d}"],
                                      config=config))
    return nodes, leases


def _in_threads(fns) -> list:
    out: list = [None] * len(fns)

    def run(i):
        try:
            out[i] = fns[i]()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    return out


def _together(nodes) -> list:
    return _in_threads([node.next_round for node in nodes])


def test_a_round_closes_with_every_node_and_ranks_by_sorted_id(clients, job):
    nodes, _ = _nodes(clients, job, N, min_nodes=2)
    rounds = _together(nodes)
    assert all(r.number == 0 for r in rounds), rounds
    ids = tuple(f"node-{i:02d}" for i in range(N))
    assert {r.members for r in rounds} == {ids}
    assert {(r.node, r.rank, r.world_size) for r in rounds} == {(n, i, N) for i, n in enumerate(ids)}
    assert len({r.closed_by for r in rounds}) == 1 and rounds[0].reason == f"max_nodes={N} joined"
    value, meta = clients[0].get(rendezvous_key(job, 0, "close", "members"))
    assert json.loads(value)["members"] == list(ids) and meta.version == 1


def test_exactly_one_of_many_concurrent_closing_transactions_wins(clients, job):
    nodes, _ = _nodes(clients, job, N)
    joins = _in_threads([lambda node=node: node._join(0) for node in nodes])
    as_of = max(revision for revision, _ in joins)
    # every node closes at once, each with a membership of its own making: one transaction may win
    rounds = _in_threads([lambda node=node: node._write_close(0, [node.node], "test", as_of) for node in nodes])
    assert len({(r.members, r.closed_by) for r in rounds}) == 1, rounds
    winner = rounds[0].closed_by
    assert rounds[0].members == (winner,)
    value, meta = clients[0].get(rendezvous_key(job, 0, "close", "members"))
    assert json.loads(value)["closed_by"] == winner and meta.version == 1  # written once, never overwritten


def test_a_lost_lease_opens_the_next_round_and_the_survivors_agree_on_it(clients, job):
    nodes, leases = _nodes(clients, job, N, min_nodes=N // 2)
    _together(nodes)
    watches = [node.watch() for node in nodes]
    clients[1].revoke_lease(leases["node-05"].id)  # as when its lease runs out
    assert all(w.wait(30) for w in watches)
    assert {w.lost for w in watches} == {"node-05"} and not any(w.error for w in watches)
    survivors = [node for node in nodes if node.node != "node-05"]
    rounds = _together(survivors)
    expected = tuple(f"node-{i:02d}" for i in range(N) if i != 5)
    assert {(r.number, r.members) for r in rounds} == {(1, expected)}, rounds
    assert sorted(r.rank for r in rounds) == list(range(N - 1))
    assert rounds[0].reason == "every living member of the previous round is back"
    # round 1's close deleted round 0: the job keeps the previous and the current round only
    assert list(clients[0].get_prefix(rendezvous_key(job, 0))) == []


def test_a_member_whose_lease_stopped_being_renewed_is_not_waited_for_until_it_runs_out(clients, job):
    """A node powered off or cut off keeps its key until its lease runs out (the TTL: 6 s in a multi-node
    `trainwarden run`). The survivors' round no longer waits that long, nor its last call (60 s here): once the
    lease has gone two keep-alive periods (a third of its TTL each) without renewal, the node is taken for lost."""
    config = NativeRendezvousConfig(min_nodes=2, max_nodes=3, last_call_s=60.0, join_timeout_s=40.0)
    leases = {"node-00": clients[0].lease(60), "node-01": clients[1].lease(60), "node-02": clients[2].lease(6)}
    nodes = [NativeRendezvous(clients[i], job=job, node=name, lease=lease, config=config)
             for i, (name, lease) in enumerate(leases.items())]
    assert {r.members for r in _together(nodes)} == {("node-00", "node-01", "node-02")}
    # node-02 never renews its lease from here on, as a node that lost its power
    rounds = _together(nodes[:2])
    assert {(r.number, r.members) for r in rounds} == {(1, ("node-00", "node-01"))}, rounds
    assert rounds[0].reason == ("every living member of the previous round is back (node-02: lease not renewed "
                                "for two keep-alive periods, taken for lost)"), rounds[0].reason
    # the live members' leases, renewed or not, were never judged: a third of their TTL is far off
    assert all(clients[0].get_lease_info(leases[n].id).TTL > 20 for n in ("node-00", "node-01"))


def test_a_node_that_comes_after_the_close_waits_for_the_next_round(clients, job):
    members, _ = _nodes(clients, job, N - 1)
    rounds = _together(members)
    assert {r.world_size for r in rounds} == {N - 1}
    late, _ = _nodes(clients, job, 1, first=N - 1, min_nodes=N, max_nodes=N)  # round 1's closer: it takes N
    result: list = []
    thread = threading.Thread(target=lambda: result.append(late[0].next_round()))
    thread.start()
    for _ in range(500):
        if members[0].waiting() == 1:
            break
        threading.Event().wait(0.02)
    assert members[0].waiting() == 1
    assert thread.is_alive() and not result  # round 0 is intact: the late node is not let in alone
    value, _ = clients[0].get(rendezvous_key(job, 0, "close", "members"))
    assert f"node-{N - 1:02d}" not in json.loads(value)["members"]
    rounds = _together(members)  # the members regroup, as torchrun's agent does on waiting nodes
    thread.join(30)
    everyone = tuple(f"node-{i:02d}" for i in range(N))
    assert {(r.number, r.members) for r in rounds + result} == {(1, everyone)}


def test_an_etcd_that_went_away_is_a_clear_retryable_error(tmp_path):
    server = EmbeddedEtcd(data_dir=tmp_path / "etcd", log_path=tmp_path / "etcd.log")
    server.start()
    client = open_client("127.0.0.1", server.client_port, timeout=2.0)
    try:
        node = NativeRendezvous(client, job="gone", node="node-00", lease=client.lease(30),
                                config=NativeRendezvousConfig(min_nodes=1, max_nodes=1))
        server.stop()
        with pytest.raises(NativeRendezvousUnavailable, match="check that etcd is running"):
            node.next_round()
    finally:
        client.close()
        server.stop()


# -- behind torchrun: --rdzv-backend etcd3 --rdzv-conf round=native (native_handler.py) ---------------------


def _handlers(etcd, run_id, n, **conf):
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    params = dict(backend="etcd3", endpoint=etcd.endpoint, run_id=run_id, min_nodes=2, max_nodes=n,
                  local_addr="127.0.0.1", round="native", join_timeout="40", last_call_timeout="30")
    params.update(conf)
    return [get_rendezvous_handler(RendezvousParameters(**params)) for _ in range(n)]


@pytest.mark.timeout(90)
def test_the_handler_forms_a_world_and_a_lost_node_makes_the_survivors_regroup(etcd, job):
    from trainwarden.agent.rendezvous.native_handler import NativeRendezvousHandler

    handlers = _handlers(etcd, job, 3)
    try:
        assert all(isinstance(h, NativeRendezvousHandler) for h in handlers)
        infos = _in_threads([h.next_rendezvous for h in handlers])
        assert sorted((i.rank, i.world_size) for i in infos) == [(0, 3), (1, 3), (2, 3)], infos
        master = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}
        assert len(master) == 1 and all(h.num_nodes_waiting() == 0 for h in handlers)
        dead = handlers.pop()
        dead._stop.set()
        dead._client.revoke_lease(dead._lease.id)  # the node is gone: its lease with it
        for _ in range(500):
            if all(h.num_nodes_waiting() >= 1 for h in handlers):
                break
            threading.Event().wait(0.02)
        assert all(h.num_nodes_waiting() >= 1 for h in handlers)  # torchrun's agent restarts on this
        infos = _in_threads([h.next_rendezvous for h in handlers])
        assert sorted((i.rank, i.world_size) for i in infos) == [(0, 2), (1, 2)], infos
    finally:
        for h in handlers:
            h.shutdown()
    assert handlers[0].is_closed()


@pytest.mark.timeout(90)
def test_a_node_whose_lease_lapsed_while_it_waited_joins_the_round_again_at_once(etcd, job):
    """Issue 45: a node whose lease lapsed while it waited in a round lost its key with it and was not
    re-registered, so a round that needed it waited until the join timeout (at 1,000 nodes, never closed)."""
    handlers = _handlers(etcd, job, 2, join_timeout="20", keep_alive_interval="1", keep_alive_max_attempt="3")
    first, second = handlers
    try:
        results: list = []
        waiting = threading.Thread(target=lambda: results.append(first.next_rendezvous()), daemon=True)
        waiting.start()
        joined = first._rdzv._key(0, "nodes") + "/"
        for _ in range(500):  # first waits in round 0
            if first._client.get_prefix_response(joined, keys_only=True).kvs:
                break
            threading.Event().wait(0.02)
        lapsed = first._lease.id
        first._client.revoke_lease(lapsed)  # as etcd does to a lease that was not renewed in time
        for _ in range(500):  # the keeper sees it within a third of the TTL and grants a new one
            if first._lease.id != lapsed:
                break
            threading.Event().wait(0.02)
        # before the fix this waited for a node whose key had gone, and timed out after join_timeout (20 s)
        info = second.next_rendezvous()
        waiting.join(30)
        assert results and sorted([results[0].world_size, info.world_size]) == [2, 2]
    finally:
        for h in handlers:
            h.shutdown()


@pytest.mark.timeout(90)
def test_rank_0s_agent_hosts_a_new_workers_store_every_round(etcd, job):
    """The workers' TCPStore is up before any worker dials it (no connection refused, no back-off), and a
    round's store is not the one before: the old server is stopped, its keys gone with it."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    def client(info):
        return TCPStore(info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port,
                        is_master=False, timeout=timedelta(seconds=5))

    handlers = _handlers(etcd, job, 2)
    try:
        assert all(h.use_agent_store for h in handlers)  # so torch's workers connect as clients, rank 0 too
        first = _in_threads([h.next_rendezvous for h in handlers])
        assert len({(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in first}) == 1
        worker = client(first[0])
        worker.set("from-round-1", "x")
        assert client(first[1]).get("from-round-1") == b"x"
        hosts = [h for h, i in zip(handlers, first) if i.rank == 0]
        assert len(hosts) == 1 and hosts[0]._workers_store.port == first[0].bootstrap_store_info.master_port
        second = _in_threads([h.next_rendezvous for h in handlers])  # a restart: the agents ask again
        assert second[0].bootstrap_store_info.master_port != first[0].bootstrap_store_info.master_port
        assert not client(second[0]).check(["from-round-1"])
        with pytest.raises(Exception):  # the first round's server is gone
            client(first[0])
    finally:
        for h in handlers:
            h.shutdown()
    assert all(h._workers_store is None for h in handlers)


@pytest.mark.timeout(90)
def test_the_workers_store_listens_on_the_nodes_address_only(etcd, job):
    """Issue 44, item 6: torch's TCPStore server listened on every interface whatever host it was given; a client
    on another address of the host read and wrote the workers' keys. Now only ``local_addr`` (here loopback) serves."""
    import host_address

    if host_address.unavailable():
        pytest.skip(host_address.unavailable())
    handlers = _handlers(etcd, job, 2)
    try:
        infos = _in_threads([h.next_rendezvous for h in handlers])
        port = infos[0].bootstrap_store_info.master_port
        assert infos[0].bootstrap_store_info.master_addr == "127.0.0.1"
        assert host_address.connects("127.0.0.1", port)  # the workers reach it
        with host_address.other_address() as other:
            assert not host_address.connects(other, port), f"the workers' store answers on {other}:{port}"
    finally:
        for h in handlers:
            h.shutdown()


@pytest.mark.timeout(180)
def test_torchrun_agents_train_on_the_native_round(etcd, procs, tmp_path, job):
    import os
    import re
    import sys
    from pathlib import Path

    worker = Path(__file__).with_name("rdzv_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    nodes = [procs.spawn([sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", "etcd3",
                          "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", job, "--rdzv-conf", "round=native",
                          "--local-addr", "127.0.0.1", "--monitor-interval", "0.5", "--nnodes", "2",
                          "--nproc-per-node", "2", "--log-dir", str(tmp_path / f"torchelastic{i}"),  # not /tmp's
                          str(worker)], log=tmp_path / f"node{i}.log", env=env)
             for i in range(2)]
    results = {}
    for proc in nodes:
        rc = proc.wait(150)
        log = proc.log_path.read_text(errors="replace")
        assert rc == 0, log[-4000:]
        for r, w, n, s, ok in re.findall(r"RESULT rank=(\d+) world=(\d+) restart=(\d+) sum=([-\d.e+]+) ok=(\w+)", log):
            results[int(r)] = (int(w), int(n), float(s), ok == "True")
    assert results == {rank: (4, 0, 10.0, True) for rank in range(4)}
    # the native round ran, not torch's: round 0 closed with both agents, and no dynamic-rendezvous blob
    client = open_client("127.0.0.1", etcd.client_port, timeout=10.0)
    try:
        members, _ = client.get(rendezvous_key(job, 0, "close", "members"))
        assert len(json.loads(members)["members"]) == 2
        assert client.get(f"/trainwarden/v1/rdzv/{job}/state")[0] is None
        assert client.get(f"/trainwarden/v1/rdzv/{job}/closed")[0] is not None  # shut down at the end
    finally:
        client.close()


@pytest.mark.timeout(90)
def test_the_handler_sees_a_loss_without_its_watch_and_an_etcd_outage_is_no_loss(tmp_path, job):
    server = EmbeddedEtcd(data_dir=tmp_path / "etcd", log_path=tmp_path / "etcd.log")
    server.start()
    handlers = []
    try:
        handlers = _handlers(server, job, 3)
        assert sorted(i.rank for i in _in_threads([h.next_rendezvous for h in handlers])) == [0, 1, 2]
        server.kill()  # etcd away: no loss, no restart of the workers (the backend's wrapper answers 0)
        assert [h.num_nodes_waiting() for h in handlers] == [0, 0, 0]
        # asked on every monitor tick through the outage: the watch's stream breaks, the client drops its watcher
        # and its endpoint (reading the watcher then raised NoServerAvailableError out of num_nodes_waiting, which
        # ended torchrun's agent: seen in a 3-member etcd's loss of quorum)
        for _ in range(40):
            assert [h.num_nodes_waiting() for h in handlers] == [0, 0, 0]
            threading.Event().wait(0.1)
        server.restart()
        for _ in range(200):
            try:
                if [h.num_nodes_waiting() for h in handlers] == [0, 0, 0]:
                    break
            except Exception:  # noqa: BLE001 - the clients reconnect
                pass
            threading.Event().wait(0.05)
        assert [h.num_nodes_waiting() for h in handlers] == [0, 0, 0]
        survivor, dead = handlers[0], handlers[2]
        survivor._watch.cancel()  # as if its watch had died without a word (python3-etcd3's broken-stream path)
        survivor._watch = None
        dead._stop.set()
        dead._client.revoke_lease(dead._lease.id)
        assert survivor.num_nodes_waiting() == 1  # the count of the round's keys says it
    finally:
        for h in handlers[:2]:
            h.shutdown()
        server.stop()


@pytest.mark.timeout(90)
def test_a_watch_lost_after_etcd_compacted_the_rounds_close_is_made_again_from_now(etcd, job):
    """Auto-compaction removes the revision a round closed at while the round trains on; a watch made again then
    starts from now, and the count of the round's keys still sees a loss (issue 28)."""
    handlers = _handlers(etcd, job, 3)
    try:
        _in_threads([h.next_rendezvous for h in handlers])
        client = open_client("127.0.0.1", etcd.client_port, timeout=10.0)
        try:
            client.put(f"/trainwarden/v1/rdzv/{job}/filler", "x")
            _, meta = client.get(f"/trainwarden/v1/rdzv/{job}/filler")
            client.compact(meta.mod_revision)
        finally:
            client.close()
        survivor, dead = handlers[0], handlers[2]
        survivor._watch.cancel()  # as if its stream had broken: it must be made again, past the compaction
        survivor._watch = None
        assert survivor.num_nodes_waiting() == 0 and survivor._watch is not None and survivor._watch.alive()
        dead._stop.set()
        dead._client.revoke_lease(dead._lease.id)
        for _ in range(500):
            if survivor.num_nodes_waiting() == 1:
                break
            threading.Event().wait(0.02)
        assert survivor.num_nodes_waiting() == 1  # from the new watch's delete event
    finally:
        for h in handlers[:2]:
            h.shutdown()


def _wait_until(predicate, what: str):
    for _ in range(1500):
        if predicate():
            return
        threading.Event().wait(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.timeout(90)
def test_a_node_behind_a_full_round_is_a_spare_that_restarts_nobody_and_takes_a_lost_members_rank(etcd, job):
    """Issue 47: a node past max_nodes was counted as waiting to join, so torchrun restarted the full round every
    few seconds for a node that could not get in. It waits as a spare now, and takes the rank of a lost member."""
    handlers = _handlers(etcd, job, 3, max_nodes=2)
    *trainers, spare = handlers
    try:
        infos = _in_threads([h.next_rendezvous for h in trainers])
        assert sorted((i.rank, i.world_size) for i in infos) == [(0, 2), (1, 2)]
        waiting_in, took = [], []
        spare.on_wait = waiting_in.append
        thread = threading.Thread(target=lambda: took.append(spare.next_rendezvous()), daemon=True)
        thread.start()
        _wait_until(lambda: waiting_in, "the spare to wait")
        assert waiting_in == [1] and trainers[0]._rdzv.waiting() == 1  # it is there, in round 1 ...
        assert [h.num_nodes_waiting() for h in trainers] == [0, 0]  # ... and no trainer restarts for it
        lost = next(h for h, i in zip(trainers, infos) if i.rank == 0)  # rank 0's node is lost
        survivor = next(h for h in trainers if h is not lost)
        lost._stop.set()
        lost._client.revoke_lease(lost._lease.id)
        handlers.remove(lost)
        _wait_until(lambda: survivor.num_nodes_waiting() >= 1, "the survivor to see the loss")
        info = survivor.next_rendezvous()
        thread.join(30)
        assert (info.rank, info.world_size) == (1, 2)  # the survivor keeps its rank
        assert took and (took[0].rank, took[0].world_size) == (0, 2)  # the spare takes the lost one's
    finally:
        for h in handlers:
            h.shutdown()


@pytest.mark.timeout(90)
def test_a_spare_that_was_never_needed_ends_without_error_when_the_job_does(etcd, job):
    from torch.distributed.elastic.rendezvous import RendezvousGracefulExitError

    handlers = _handlers(etcd, job, 3, max_nodes=2)
    *trainers, spare = handlers
    try:
        _in_threads([h.next_rendezvous for h in trainers])
        ended: list = []

        def wait():
            try:
                spare.next_rendezvous()
            except Exception as exc:  # noqa: BLE001 - the test reads it
                ended.append(exc)

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        _wait_until(lambda: trainers[0]._rdzv.waiting() == 1, "the spare to wait")
        for h in trainers:  # the job is over: torchrun's agents shut the rendezvous down
            h.shutdown()
        thread.join(30)
        assert ended and isinstance(ended[0], RendezvousGracefulExitError), ended
        assert "closed (the job ended) while node" in str(ended[0])
    finally:
        spare.shutdown()


@pytest.mark.timeout(90)
def test_a_node_that_restarts_after_the_others_finished_the_job_ends_without_error(etcd, job):
    """Soak run D: a node's worker took 30 s to stop after a crash; the other node's workers trained the last steps
    alone and their agent shut the rendezvous down. The late node's next round must end its agent as finished, not
    with RendezvousClosedError (its `trainwarden run` failed a job that had succeeded). A node that closed it after
    its workers failed still ends the others with the error, and says how it ended."""
    from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousGracefulExitError

    for outcome, raised in (("SUCCEEDED", RendezvousGracefulExitError), ("FAILED", RendezvousClosedError)):
        handlers = _handlers(etcd, f"{job[:50]}-{outcome.lower()}", 2)
        finisher, late = handlers
        try:
            _in_threads([h.next_rendezvous for h in handlers])
            finisher.job_outcome = outcome  # what the launcher sets before torch's agent shuts the handler down
            finisher.shutdown()
            with pytest.raises(raised) as ended:
                late.next_rendezvous()
            assert finisher.node in str(ended.value) and outcome.lower() in str(ended.value).lower()
            assert late.closed_by() == (finisher.node, outcome)
        finally:
            late.shutdown()


@pytest.mark.timeout(90)
def test_a_new_round_deletes_the_bootstrap_keys_of_the_rounds_before_it(etcd, job):
    """Issue 45's nothing_left: at the end of the soak's hour the job's earlier rounds' bootstrap keys
    (``rdzv/<job>/store/native/<round>/``: the workers' store address, torch's assigned ranks) were still in etcd, a
    round's worth for each restart of a job that may restart hundreds of times. Rank 0 of a round deletes them."""
    handlers = _handlers(etcd, job, 2)
    client = open_client("127.0.0.1", etcd.client_port, timeout=10.0)
    prefix = f"/trainwarden/v1/rdzv/{job}/store/native/"

    def rounds() -> set[str]:
        return {m.key.decode()[len(prefix):].split("/", 1)[0] for _, m in client.get_prefix(prefix, keys_only=True)}

    try:
        first = _in_threads([h.next_rendezvous for h in handlers])
        assert rounds() == {"0"} and all(not isinstance(i, Exception) for i in first), first
        second = _in_threads([h.next_rendezvous for h in handlers])  # a restart: both nodes ask for the next round
        assert sorted((i.rank, i.world_size) for i in second) == [(0, 2), (1, 2)], second
        assert rounds() == {"1"}
    finally:
        for h in handlers:
            h.shutdown()
        client.close()

"""The native rendezvous' closing rule (pure, with a fake clock) and its etcd protocol against a fake etcd.

The fake keeps what the protocol relies on: one revision per transaction, create/mod revisions, leases whose
revocation deletes their keys, nested transactions, prefix reads (keys only, count only, limit) and watches
that replay history from a start revision. The real etcd runs in tests/integration/test_rendezvous_native_etcd.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
from etcd3 import events as etcd_events
from etcd3.client import Transactions
from etcd3.etcdrpc import kv_pb2, rpc_pb2
from etcd3.transactions import Delete, Get, Put, Txn
from etcd3.watch import WatchResponse

from trainwarden.agent.etcd.keys import rendezvous_key
from trainwarden.agent.rendezvous.native import (CloseRule, NativeRendezvous, NativeRendezvousClosed,
                                                 NativeRendezvousConfig, NativeRendezvousError,
                                                 NativeRendezvousTimeout)

pytestmark = pytest.mark.timeout(30)


# -- the closing rule -----------------------------------------------------------------------------------


def _rule(min_nodes=2, max_nodes=4, last_call_s=5.0, previous=None) -> CloseRule:
    rule = CloseRule(NativeRendezvousConfig(min_nodes=min_nodes, max_nodes=max_nodes, last_call_s=last_call_s))
    rule.previous = frozenset(previous) if previous is not None else None
    return rule


def test_a_round_closes_at_once_when_max_nodes_have_joined():
    rule = _rule()
    for rev, node in enumerate("dcba", start=10):
        assert not rule.decide(now=0.0).close
        rule.join(node, rev)
    decision = rule.decide(now=0.0)
    assert decision.close and "max_nodes=4" in decision.reason
    assert rule.members() == ["a", "b", "c", "d"]


def test_below_min_nodes_a_round_waits_for_an_event_not_a_clock():
    rule = _rule(min_nodes=3)
    rule.join("a", 1)
    rule.join("b", 2)
    decision = rule.decide(now=1000.0)
    assert not decision.close and decision.wake_at is None


def test_the_last_call_runs_from_min_nodes_and_restarts_when_a_node_leaves_below_it():
    rule = _rule(min_nodes=2, last_call_s=5.0)
    rule.join("a", 1)
    rule.join("b", 2)
    assert rule.decide(now=10.0).wake_at == 15.0
    assert not rule.decide(now=14.9).close
    rule.leave("b")
    assert rule.decide(now=16.0).wake_at is None  # below min again: no close, no deadline
    rule.join("c", 3)
    assert rule.decide(now=20.0).wake_at == 25.0
    decision = rule.decide(now=25.0)
    assert decision.close and "last call" in decision.reason
    assert rule.members() == ["a", "c"]


def test_members_are_the_first_max_nodes_joins_sorted_by_id():
    rule = _rule(min_nodes=1, max_nodes=3)
    for node, rev in (("z", 5), ("m", 6), ("a", 9), ("b", 7)):
        rule.join(node, rev)
    assert rule.members() == ["b", "m", "z"]  # "a" joined fourth


def test_after_a_loss_a_newcomer_takes_the_lost_members_position_and_the_others_keep_theirs():
    """Issue 47: the spare takes the lost node's ranks; no survivor moves (no resharding at the same size)."""
    rule = _rule(min_nodes=3, max_nodes=3)
    rule.set_previous(["c", "a", "b"])  # a previous round's order is kept as it was, not re-sorted
    rule.previous_gone("a")
    for node, rev in (("spare", 1), ("b", 2), ("c", 3)):
        rule.join(node, rev)
    assert rule.decide(now=0.0).close
    assert rule.members() == ["c", "spare", "b"]


def test_a_shrink_closes_up_the_lost_positions_and_a_grow_appends_the_newcomers():
    shrink = _rule(min_nodes=1, max_nodes=4)
    shrink.set_previous(["a", "b", "c"])
    for node, rev in (("c", 1), ("a", 2)):
        shrink.join(node, rev)
    assert shrink.members() == ["a", "c"]
    grow = _rule(min_nodes=1, max_nodes=4)
    grow.set_previous(["b", "a"])
    for node, rev in (("z", 1), ("y", 2), ("a", 3), ("b", 4)):
        grow.join(node, rev)
    assert grow.members() == ["b", "a", "z", "y"]  # the newcomers in join order, after the members
    full = _rule(min_nodes=1, max_nodes=2)  # two of three newcomers fill two lost positions; the third waits
    full.set_previous(["a", "b"])
    for node, rev in (("x", 1), ("y", 2), ("w", 3)):
        full.join(node, rev)
    assert full.members() == ["x", "y"]


def test_nodes_after_an_intact_round_wait_even_at_max_nodes():
    rule = _rule(min_nodes=1, max_nodes=2, previous={"p1", "p2"})
    rule.join("late1", 1)
    rule.join("late2", 2)
    assert not rule.decide(now=0.0).close
    rule.join("p1", 3)  # a member of the previous round re-joins: that round is over ...
    decision = rule.decide(now=0.0)  # ... but the round waits for p2, alive, rather than give its place away
    assert not decision.close and decision.wake_at == 5.0
    rule.join("p2", 4)
    assert rule.decide(now=0.1).close
    rule.set_previous(["p1", "p2"])
    assert rule.members() == ["p1", "p2"]  # the nodes that waited longer stay out: they came after a full round


def test_spares_that_waited_first_never_push_a_survivor_out():
    """Issue 47: two spares waited in the next round before the survivor re-joined it. The round closed at once at
    max_nodes with the first joins, the two spares, and the survivor (alive, its state in its memory) waited."""
    rule = _rule(min_nodes=2, max_nodes=2)
    rule.set_previous(["a", "b"])
    rule.join("s1", 1)
    rule.join("s2", 2)
    rule.previous_gone("b")  # b is lost
    assert not rule.decide(now=0.0).close  # a, alive, is not back yet
    rule.join("a", 3)
    assert rule.decide(now=0.1).close
    assert rule.members() == ["a", "s1"]  # a keeps rank 0; the first spare takes b's; s2 still waits
    three = _rule(min_nodes=2, max_nodes=3)
    three.set_previous(["a", "b", "c"])
    for node, rev in (("s1", 1), ("s2", 2), ("a", 3), ("b", 4)):
        three.join(node, rev)
    three.previous_gone("c")
    assert three.decide(now=0.0).close and three.members() == ["a", "b", "s1"]


def test_a_restart_closes_once_every_living_member_is_back_without_the_last_call():
    rule = _rule(min_nodes=1, max_nodes=8, last_call_s=60.0, previous={"a", "b", "c"})
    rule.previous_gone("c")  # lost
    rule.previous_gone("stranger")  # not a member: ignored
    rule.join("a", 1)
    decision = rule.decide(now=0.0)
    assert not decision.close and decision.wake_at == 60.0  # b is alive and not back yet
    rule.join("b", 2)
    decision = rule.decide(now=0.1)
    assert decision.close and "every living member" in decision.reason
    assert rule.members() == ["a", "b"]


def test_a_member_presumed_lost_is_not_awaited_and_the_close_says_so():
    rule = _rule(min_nodes=2, max_nodes=3, last_call_s=60.0, previous={"a", "b", "c"})
    rule.join("a", 20)
    assert rule.awaited() == frozenset()  # below min_nodes: no last call yet, nobody is awaited by it
    rule.join("b", 21)
    assert not rule.decide(100.0).close and rule.awaited() == {"c"}
    rule.presume_lost("x")  # not of the previous round: nothing
    assert rule.awaited() == {"c"} and not rule.decide(100.5).close
    rule.presume_lost("c")
    decision = rule.decide(101.0)
    assert decision.close and decision.reason == ("every living member of the previous round is back (c: lease "
                                                  "not renewed for two keep-alive periods, taken for lost)")
    assert rule.members() == ["a", "b"]


@pytest.mark.parametrize("kwargs, words", [
    ({"min_nodes": 0, "max_nodes": 1}, ">= 1"),
    ({"min_nodes": 3, "max_nodes": 2}, "MIN <= MAX"),
    ({"min_nodes": 1, "max_nodes": 1, "last_call_s": -1}, "last_call_s"),
    ({"min_nodes": 1, "max_nodes": 1, "join_timeout_s": 0}, "join_timeout_s"),
])
def test_config_refuses_what_cannot_work_and_says_what_to_give(kwargs, words):
    with pytest.raises(ValueError, match=words):
        NativeRendezvousConfig(**kwargs)


def test_the_module_does_not_import_torch():
    code = "import sys, trainwarden.agent.rendezvous.native; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=25)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# -- the protocol against a fake etcd ---------------------------------------------------------------------


def _kv(key, value, create, mod, version=1) -> kv_pb2.KeyValue:
    return kv_pb2.KeyValue(key=key, value=value, create_revision=create, mod_revision=mod, version=version)


class _Meta:
    def __init__(self, kv):
        self.key, self.mod_revision, self.create_revision = kv.key, kv.mod_revision, kv.create_revision


class FakeEtcd:
    """An in-memory etcd v3 with the surface NativeRendezvous uses (see the module docstring)."""

    transactions = Transactions()

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.revision = 1
        self.kv: dict[bytes, kv_pb2.KeyValue] = {}
        self.leases: dict[bytes, int] = {}
        self.history: list[kv_pb2.Event] = []
        self.watches: dict[int, tuple[bytes, bytes, object]] = {}
        self.txns = 0

    # reads
    def _range(self, key: bytes, end: bytes | None):
        if end is None:
            return [self.kv[key]] if key in self.kv else []
        return [self.kv[k] for k in sorted(self.kv) if key <= k < end]

    def get(self, key):
        with self.lock:
            found = self._range(key.encode(), None)
            return (found[0].value, _Meta(found[0])) if found else (None, None)

    def get_prefix_response(self, prefix, keys_only=False, count_only=False, limit=None):
        with self.lock:
            found = self._range(prefix.encode(), _end(prefix.encode()))
            kvs = [] if count_only else found[:limit] if limit else found
            if keys_only:
                kvs = [_kv(kv.key, b"", kv.create_revision, kv.mod_revision) for kv in kvs]
            return rpc_pb2.RangeResponse(header=rpc_pb2.ResponseHeader(revision=self.revision), kvs=kvs,
                                         count=len(found))

    # writes: one revision per write request
    def _put(self, key: bytes, value: bytes, lease) -> None:
        old = self.kv.get(key)
        kv = _kv(key, value, old.create_revision if old else self.revision, self.revision,
                 old.version + 1 if old else 1)
        self.kv[key] = kv
        if lease:
            self.leases[key] = getattr(lease, "id", lease)
        self._event(kv_pb2.Event(type=kv_pb2.Event.PUT, kv=kv))

    def _delete(self, key: bytes, end: bytes | None) -> None:
        for kv in self._range(key, end):
            del self.kv[kv.key]
            self.leases.pop(kv.key, None)
            self._event(kv_pb2.Event(type=kv_pb2.Event.DELETE, kv=_kv(kv.key, b"", 0, self.revision, 0)))

    def _event(self, event) -> None:
        self.history.append(event)
        for key, end, callback in list(self.watches.values()):
            if key <= event.kv.key < end:
                callback(WatchResponse(rpc_pb2.ResponseHeader(revision=self.revision), [etcd_events.new_event(event)]))

    def _holds(self, compare) -> bool:
        found = self._range(compare.key.encode(), None)
        version = found[0].version if found else 0
        assert compare.op == rpc_pb2.Compare.EQUAL and type(compare).__name__ == "Version"
        return version == compare.value

    def _apply(self, ops) -> list:
        out = []
        for op in ops:
            if isinstance(op, Put):
                self._put(op.key.encode(), op.value.encode(), op.lease)
                out.append(rpc_pb2.ResponseOp(response_put=rpc_pb2.PutResponse(
                    header=rpc_pb2.ResponseHeader(revision=self.revision))))
            elif isinstance(op, Get):
                out.append([(kv.value, _Meta(kv)) for kv in self._range(op.key.encode(), None)])
            elif isinstance(op, Delete):
                self._delete(op.key.encode(), op.range_end)
                out.append(rpc_pb2.ResponseOp(response_delete_range=rpc_pb2.DeleteRangeResponse()))
            elif isinstance(op, Txn):
                ok = all(self._holds(c) for c in op.compare)
                inner = []
                for r in self._apply(op.success if ok else op.failure):
                    if isinstance(r, list):
                        r = rpc_pb2.ResponseOp(response_range=rpc_pb2.RangeResponse(kvs=[
                            _kv(m.key, v, m.create_revision, m.mod_revision) for v, m in r]))
                    inner.append(r)
                out.append(rpc_pb2.ResponseOp(response_txn=rpc_pb2.TxnResponse(succeeded=ok, responses=inner)))
        return out

    def transaction(self, compare, success=None, failure=None):
        with self.lock:
            self.txns += 1
            ok = all(self._holds(c) for c in compare)
            self.revision += 1
            return ok, self._apply(success if ok else failure)

    def delete(self, key):
        with self.lock:
            self.revision += 1
            self._delete(key.encode(), None)

    def revoke_lease(self, lease_id):
        with self.lock:
            self.revision += 1
            for key in [k for k, lease in self.leases.items() if lease == lease_id]:
                self._delete(key, None)

    # watches
    def add_watch_prefix_callback(self, prefix, callback, start_revision=None):
        with self.lock:
            key, end = prefix.encode(), _end(prefix.encode())
            for event in self.history:
                if key <= event.kv.key < end and event.kv.mod_revision >= (start_revision or self.revision + 1):
                    callback(WatchResponse(rpc_pb2.ResponseHeader(revision=self.revision),
                                           [etcd_events.new_event(event)]))
            watch_id = len(self.watches) + 1000 + self.revision
            self.watches[watch_id] = (key, end, callback)
            return watch_id

    def cancel_watch(self, watch_id):
        with self.lock:
            self.watches.pop(watch_id, None)


def _end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])


def _nodes(etcd, n, *, min_nodes=None, max_nodes=None, last_call_s=0.0, join_timeout_s=20.0, first=0, resync_s=5.0):
    config = NativeRendezvousConfig(min_nodes=min_nodes or n, max_nodes=max_nodes or n, last_call_s=last_call_s,
                                    join_timeout_s=join_timeout_s, resync_s=resync_s)
    return [NativeRendezvous(etcd, job="j", node=f"n{i:02d}", lease=100 + i, config=config)
            for i in range(first, first + n)]


def _together(nodes) -> list:
    out: list = [None] * len(nodes)

    def run(i):
        try:
            out[i] = nodes[i].next_round()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(25)
    return out


def test_every_node_gets_the_same_round_and_a_rank_from_the_sorted_ids():
    etcd = FakeEtcd()
    rounds = _together(_nodes(etcd, 5))
    assert {r.members for r in rounds} == {("n00", "n01", "n02", "n03", "n04")}
    assert sorted((r.node, r.rank) for r in rounds) == [(f"n{i:02d}", i) for i in range(5)]
    assert etcd.txns == 6  # five joins and one close: no node's write is retried against another's
    members = json.loads(etcd.get(rendezvous_key("j", 0, "close", "members"))[0])
    assert members["members"] == list(rounds[0].members) and members["closed_by"] == rounds[0].closed_by


def test_a_node_after_the_close_goes_on_to_the_next_round_and_waits_there():
    etcd = FakeEtcd()
    members = _nodes(etcd, 2)  # min = max = 2: round 0 closes with these two
    _together(members)
    late = _nodes(etcd, 1, min_nodes=3, max_nodes=3, first=7)[0]  # round 1's closer: it takes 3
    result: list = []
    thread = threading.Thread(target=lambda: result.append(late.next_round()))
    thread.start()
    while members[0].waiting() != 1:
        threading.Event().wait(0.01)
    assert thread.is_alive() and not result  # round 0 is intact: round 1 does not close
    rounds = _together(members)  # the members regroup to let it in
    thread.join(10)
    assert {(r.number, r.members) for r in rounds + result} == {(1, ("n00", "n01", "n07"))}


def test_a_spare_waits_behind_a_full_round_and_takes_the_lost_members_rank():
    etcd = FakeEtcd()
    members = _nodes(etcd, 2)  # n00 and n01 train
    _together(members)
    spare = _nodes(etcd, 1, min_nodes=2, max_nodes=2, first=5)[0]
    result: list = []
    thread = threading.Thread(target=lambda: result.append(spare.next_round()))
    thread.start()
    while members[0].waiting() != 1:
        threading.Event().wait(0.01)
    assert thread.is_alive() and not result  # the round is intact: the spare waits
    etcd.revoke_lease(100)  # n00 is lost
    survivor = members[1].next_round()
    thread.join(10)
    assert survivor.members == result[0].members == ("n05", "n01")  # the spare has rank 0, n01 keeps rank 1
    assert (result[0].rank, survivor.rank) == (0, 1)


def test_a_node_waiting_for_a_round_stops_once_the_rendezvous_is_closed():
    etcd = FakeEtcd()
    _together(_nodes(etcd, 2))
    config = NativeRendezvousConfig(min_nodes=2, max_nodes=2, last_call_s=0.0, join_timeout_s=20.0, resync_s=0.05)
    closed = threading.Event()
    spare = NativeRendezvous(etcd, job="j", node="n07", lease=107, config=config, closed=closed.is_set)
    result: list = []

    def wait():
        try:
            spare.next_round()
        except NativeRendezvousClosed as exc:
            result.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    threading.Event().wait(0.3)
    assert thread.is_alive()
    closed.set()  # the job ended
    thread.join(5)
    assert not thread.is_alive() and "closed (the job ended) while node n07 waited in round 1" in str(result[0])
    assert etcd.get_prefix_response(rendezvous_key("j", 1, "nodes"), count_only=True).count == 0  # it left


def test_a_node_that_gives_up_waiting_leaves_the_round_it_waited_in():
    etcd = FakeEtcd()
    _together(_nodes(etcd, 2))
    late = _nodes(etcd, 1, join_timeout_s=0.2, first=7)[0]
    with pytest.raises(NativeRendezvousTimeout, match="round 1 did not close with node n07 within 0.2 s"):
        late.next_round()
    assert etcd.get_prefix_response(rendezvous_key("j", 1, "nodes"), count_only=True).count == 0


def test_a_closer_whose_lease_ends_before_it_closes_is_replaced_by_exactly_one_other():
    etcd = FakeEtcd()
    stalled, *others = _nodes(etcd, 3, min_nodes=2, max_nodes=3)
    assert stalled._join(0)[1] == "n00"  # the first joiner: the closer, which never gets to close
    result: list = []
    thread = threading.Thread(target=lambda: result.extend(_together(others)))
    thread.start()
    while len(etcd.watches) < 2:  # both are waiting on close/
        threading.Event().wait(0.01)
    etcd.revoke_lease(100)  # its keys go: nodes/n00 and close/by
    thread.join(25)
    assert {r.members for r in result} == {("n01", "n02")}
    assert {r.closed_by for r in result} in ({"n01"}, {"n02"})


def test_after_a_member_is_lost_the_survivors_watch_ends_and_they_agree_on_the_next_round():
    etcd = FakeEtcd()
    nodes = _nodes(etcd, 4, min_nodes=2, max_nodes=4, last_call_s=30.0)
    _together(nodes)
    watches = [node.watch() for node in nodes]
    etcd.revoke_lease(102)  # n02
    assert all(w.wait(5) for w in watches) and {w.lost for w in watches} == {"n02"}
    rounds = _together([nodes[i] for i in (0, 1, 3)])
    assert {(r.number, r.members) for r in rounds} == {(1, ("n00", "n01", "n03"))}
    assert {r.reason for r in rounds} == {"every living member of the previous round is back"}
    # the close of round 1 deleted round 0's keys: at most the previous and the current round are kept
    assert etcd.get_prefix_response(rendezvous_key("j", 0), count_only=True).count == 0


def test_a_member_that_leaves_on_purpose_ends_the_round_for_the_others():
    etcd = FakeEtcd()
    nodes = _nodes(etcd, 3, min_nodes=2, max_nodes=3, last_call_s=30.0)
    _together(nodes)
    watches = [node.watch() for node in nodes]
    thread = threading.Thread(target=nodes[0].next_round)
    thread.start()  # it deletes its round-0 key, then waits in round 1
    assert watches[1].wait(5) and watches[1].lost == "n00"
    rounds = _together(nodes[1:])
    thread.join(10)
    assert {r.members for r in rounds} == {("n00", "n01", "n02")} and nodes[0].last.number == 1


def test_watches_that_deliver_nothing_cost_a_resync_not_the_round():
    class DeafWatches(FakeEtcd):
        def add_watch_prefix_callback(self, prefix, callback, start_revision=None):
            return 1  # created, and never a word (a broken stream, a client that mixed its watches up)

    etcd = DeafWatches()
    rounds = _together(_nodes(etcd, 4, resync_s=0.05))
    assert {(r.number, r.world_size) for r in rounds} == {(0, 4)}, rounds


def test_a_node_whose_lease_has_ended_is_told_to_get_a_new_one():
    class LeaseGone(FakeEtcd):
        def transaction(self, *a, **k):
            import grpc
            from etcd3.exceptions import Etcd3Exception

            raise Etcd3Exception("etcdserver: requested lease not found") from grpc.RpcError()

    node = _nodes(LeaseGone(), 1)[0]
    with pytest.raises(NativeRendezvousError, match="lease has ended.*grant the node a new lease"):
        node.next_round()


def test_a_member_regrouping_to_let_a_waiting_node_in_joins_before_it_leaves_so_both_are_in_the_round():
    """The soak's grow-back loop (issue 45): n00 trains alone in round 0 (min 1, max 2), n07 waits in round 1 as its
    closer, watching round 0's keys. n00 regroups to let it in. Had n00 left round 0 before joining round 1, the
    closer would see round 0's only member gone, close round 1 with itself alone, and n00 would wait in round 2:
    the nodes alternate single-node rounds. Here the closer gets every chance to: round 0's key going is held
    until round 1 has closed (or 2 s)."""

    class SlowLeave(FakeEtcd):
        def delete(self, key):
            if key == rendezvous_key("j", 0, "nodes", "n00"):
                for _ in range(200):  # until the closer has closed round 1, or 2 s
                    if self.get(rendezvous_key("j", 1, "close", "members"))[0] is not None:
                        break
                    threading.Event().wait(0.01)
            return super().delete(key)

    etcd = SlowLeave()
    member = _nodes(etcd, 1, min_nodes=1, max_nodes=2, join_timeout_s=5.0)[0]
    assert member.next_round().members == ("n00",)
    late = _nodes(etcd, 1, min_nodes=1, max_nodes=2, join_timeout_s=5.0, first=7)[0]
    result: list = []
    thread = threading.Thread(target=lambda: result.append(late.next_round()))
    thread.start()
    while member.waiting() != 1:
        threading.Event().wait(0.01)
    assert thread.is_alive() and not result  # round 0 is intact: the late node waits
    grown = member.next_round()
    thread.join(10)
    assert grown.number == 1 and grown.members == result[0].members and set(grown.members) == {"n00", "n07"}


def test_members_that_re_join_at_once_are_back_whatever_order_the_closers_two_watches_deliver_in():
    """Issue 47: n00, n01 and n02 regroup without a loss (min 2, max 3); n00 joins round 1 first and closes it. The
    others' keys in round 0 go right after their joins in round 1, but the closer watches the two rounds with two
    watches, and etcd may deliver the second's events first (an unsynced watch catches up in batches, in no order
    across watches). Taking the deletions for losses, the closer saw round 0's members all gone, closed round 1 as
    soon as min_nodes had joined, and pushed a living member out to wait in round 2 (the job shrank by a node)."""

    class JoinsLate(FakeEtcd):
        """Round 1's joins reach the watches 0.3 s after they happened; every other event at once."""

        def __init__(self) -> None:
            super().__init__()
            self.late: list = []
            threading.Thread(target=self._deliver_late, daemon=True).start()

        def _event(self, event) -> None:
            if not event.kv.key.startswith(rendezvous_key("j", 1, "nodes").encode()):
                return super()._event(event)
            self.history.append(event)
            due = threading.Event()
            threading.Timer(0.3, due.set).start()
            for key, end, callback in list(self.watches.values()):
                if key <= event.kv.key < end:
                    self.late.append((due, callback, WatchResponse(
                        rpc_pb2.ResponseHeader(revision=self.revision), [etcd_events.new_event(event)])))

        def _deliver_late(self) -> None:
            while True:
                if self.late and self.late[0][0].wait(5):
                    _, callback, response = self.late.pop(0)
                    callback(response)
                else:
                    threading.Event().wait(0.01)

    etcd = JoinsLate()
    nodes = _nodes(etcd, 3, min_nodes=2, max_nodes=3, last_call_s=30.0, join_timeout_s=4.0)
    _together(nodes)
    first: list = []
    closer = threading.Thread(target=lambda: first.append(nodes[0].next_round()))
    closer.start()
    while etcd.get(rendezvous_key("j", 1, "close", "by"))[0] is None or len(etcd.watches) < 2:
        threading.Event().wait(0.01)  # n00 closes round 1 and watches both rounds
    others = _together(nodes[1:])
    closer.join(10)
    assert [(r.number, r.members) if not isinstance(r, Exception) else r for r in first + others] == \
        [(1, ("n00", "n01", "n02"))] * 3

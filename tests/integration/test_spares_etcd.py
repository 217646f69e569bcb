"""Hot spares (issue 47) at torchrun's rendezvous handler, against a real etcd on loopback: several spares, a job of
MIN:N nodes that shrinks once no spare is left, and a node that comes back while the job runs at full size.

Each node is a ``NativeRendezvousHandler`` (what torchrun's agent calls) in this process; a node is lost when its
lease is revoked, as when it stops renewing it. The whole job on the multi-node bed: test_spares_bed.py.
"""

from __future__ import annotations

import threading

import pytest


pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def etcd(module_etcd):
    return module_etcd


@pytest.fixture
def job(request) -> str:
    return request.node.name.replace("_", "-")[:60].strip("-")


@pytest.fixture
def nodes(etcd, job):
    """``nodes(n, min_nodes=, max_nodes=[, last_call_s=])`` makes n handlers of the job; every one is shut down at the end."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    made = []

    def make(n, *, min_nodes, max_nodes, last_call_s=30):
        params = RendezvousParameters(backend="etcd3", endpoint=etcd.endpoint, run_id=job, min_nodes=min_nodes,
                                      max_nodes=max_nodes, local_addr="127.0.0.1", round="native",
                                      join_timeout="60", last_call_timeout=str(last_call_s))
        handlers = [get_rendezvous_handler(params) for _ in range(n)]
        made.extend(handlers)
        return handlers

    yield make
    for handler in made:
        if not handler._stop.is_set():
            handler.shutdown()


class _Joining:
    """``handler.next_rendezvous()`` on a thread of its own: a node that may wait (a spare) while the test goes on."""

    def __init__(self, handler) -> None:
        self.handler, self.info, self.error, self.waits = handler, None, None, []
        handler.on_wait = self.waits.append
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.info = self.handler.next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            self.error = exc

    def result(self, timeout: float = 45.0):
        self._thread.join(timeout)
        assert self.error is None, self.error
        assert self.info is not None, f"node {self.handler.node} is still waiting (in rounds {self.waits})"
        return self.info

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()


def _wait_until(predicate, what: str):
    for _ in range(2500):
        if predicate():
            return
        threading.Event().wait(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _together(handlers) -> dict:
    """Every handler's next round, joined at once: {handler: (rank, world size)}."""
    joining = [_Joining(h) for h in handlers]
    return {j.handler: (j.result().rank, j.result().world_size) for j in joining}


def _lose(handler) -> None:
    """The node is gone: its lease (and so its rendezvous key) with it."""
    handler._stop.set()
    handler._client.revoke_lease(handler._lease.id)


def _regroup(survivors, waiting=()) -> dict:
    """Once every survivor saw the loss (torchrun's agent asks ``num_nodes_waiting``), they re-join; the spares
    already waiting in the next round (``waiting``: their ``_Joining``) come with them and are waited for."""
    _wait_until(lambda: all(h.num_nodes_waiting() >= 1 for h in survivors), "the survivors to see the loss")
    ranks = _together(survivors)
    for spare in waiting:
        info = spare.result()
        ranks[spare.handler] = (info.rank, info.world_size)
    return ranks


def test_with_two_spares_a_survivor_keeps_its_place_and_the_second_spare_waits_on(nodes):
    """Both spares waited in the next round before the survivor re-joined it, so that round reached max_nodes
    with the two spares and closed at once: the survivor, alive and holding its state, was pushed out to wait as
    a spare, and its ranks went to a spare as well (a reshard nobody needed)."""
    a, b, s1, s2 = nodes(4, min_nodes=2, max_nodes=2)
    first = _together([a, b])
    spares = [_Joining(s1), _Joining(s2)]
    _wait_until(lambda: all(s.waits for s in spares), "both spares to wait")
    assert [a.num_nodes_waiting(), b.num_nodes_waiting()] == [0, 0]
    lost, survivor = (a, b) if first[a][0] == 0 else (b, a)
    _lose(lost)
    _wait_until(lambda: survivor.num_nodes_waiting() >= 1, "the survivor to see the loss")
    again = _Joining(survivor)
    assert again.result().rank == first[survivor][0] and again.result().world_size == 2  # it keeps its rank
    _wait_until(lambda: sum(s.done for s in spares) == 1, "one spare to take the lost node's rank")
    took = next(s for s in spares if s.done)
    assert (took.result().rank, took.result().world_size) == (first[lost][0], 2)
    still = next(s for s in spares if not s.done)
    _wait_until(lambda: still.waits[-1] == survivor.round_number + 1, "the other spare to wait behind the new round")
    assert [survivor.num_nodes_waiting(), took.handler.num_nodes_waiting()] == [0, 0]  # nobody restarts for it


def test_min_colon_n_replaces_a_lost_node_while_a_spare_is_left_then_shrinks(nodes):
    """--nnodes 2:3 --spare-nodes 1 on 4 nodes: 3 train, the spare waits behind the full round; the first loss
    goes to the spare at the same world size and ranks; the second, with no spare left, shrinks the job to 2
    (it waited for a node when spares needed N:N)."""
    *trainers, spare = nodes(4, min_nodes=2, max_nodes=3)
    first = _together(trainers)
    assert sorted(first.values()) == [(0, 3), (1, 3), (2, 3)]
    waiting = _Joining(spare)
    _wait_until(lambda: waiting.waits, "the spare to wait")
    assert [h.num_nodes_waiting() for h in trainers] == [0, 0, 0]  # a full round restarts for nobody
    lost = next(h for h in trainers if first[h][0] == 1)
    _lose(lost)
    survivors = [h for h in trainers if h is not lost]
    second = _regroup(survivors, [waiting])
    assert {h: second[h] for h in survivors} == {h: first[h] for h in survivors}  # the survivors keep their ranks
    assert second[spare] == (1, 3)  # the spare takes the lost node's: the world size stays 3

    lost = next(h for h in survivors if second[h][0] == 0)  # no spare is left
    _lose(lost)
    left = [h for h in survivors + [spare] if h is not lost]
    third = _regroup(left)
    assert sorted(third.values()) == [(0, 2), (1, 2)]  # shrunk to 2 ...
    assert third[spare] == (0, 2)  # ... positions closed up in the previous order (the spare was before the other)



def test_a_node_that_comes_back_to_a_full_job_waits_as_a_spare_and_restarts_nobody(nodes):
    """Item 4: a lost node's agent restarted (or a new node) while the job runs at full size with a spare in use:
    it waits as a spare and restarts nobody."""
    *trainers, spare = nodes(3, min_nodes=2, max_nodes=2)
    first = _together(trainers)
    waiting = _Joining(spare)
    _wait_until(lambda: waiting.waits, "the spare to wait")
    lost = next(h for h in trainers if first[h][0] == 1)
    _lose(lost)
    survivor = next(h for h in trainers if h is not lost)
    second = _regroup([survivor], [waiting])
    assert second == {survivor: first[survivor], spare: (1, 2)}

    back, = nodes(1, min_nodes=2, max_nodes=2)  # the lost node's agent starts again: a new rendezvous node
    returning = _Joining(back)
    _wait_until(lambda: returning.waits, "the returning node to wait")
    assert returning.waits == [survivor.round_number + 1] and not returning.done  # behind the running round
    for _ in range(3):  # asked again and again, as torchrun's agent does: nobody restarts for it
        assert [survivor.num_nodes_waiting(), spare.num_nodes_waiting()] == [0, 0]
    assert survivor._rdzv.waiting() == 1  # it is there, counted as a spare, not as a node to admit


def test_a_node_that_leaves_on_purpose_is_replaced_by_the_spare_and_every_node_calls_it_a_swap(nodes):
    """Item 3's first question: under the exclude policies a node leaves at an agreed step (regroup.py: its torchrun
    gets SIGTERM, which leaves its rendezvous key to its lease) and the others regroup. The spare takes its place
    at the same world size; the survivors' handlers call the round a swap, a regroup with nobody replaced is not."""
    *trainers, spare = nodes(4, min_nodes=3, max_nodes=3, last_call_s=3)  # `trainwarden run`'s last call
    first = _together(trainers)
    waiting = _Joining(spare)
    _wait_until(lambda: waiting.waits, "the spare to wait")
    regroup = _together(trainers)  # a regroup that replaced nobody (the spare waits behind a full round)
    assert regroup == first and not any(h.spare_swap for h in trainers) and not waiting.done
    leaver = next(h for h in trainers if first[h][0] == 1)
    leaver._stop.set()  # SIGTERM: no more keep-alives, its key stays until its lease runs out
    survivors = [h for h in trainers if h is not leaver]
    second = _together(survivors)  # asked to regroup (``restart <round>``): they re-join without a loss seen
    assert {h: second[h] for h in survivors} == {h: first[h] for h in survivors}
    assert (waiting.result().rank, waiting.result().world_size) == (1, 3)  # the spare takes the leaver's rank
    assert all(h.spare_swap for h in survivors) and not spare.spare_swap  # the spare knew no round before

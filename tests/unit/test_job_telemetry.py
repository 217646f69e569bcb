"""JobTelemetry: aggregation of worker telemetry into monotonic counters and recent-window statistics."""

import pytest

from trainwarden.agent.telemetry.job_telemetry import CollectiveTotals, JobTelemetry, WorkerInfo


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def hello(rank=0, pid=10, restart_count=0, job="j"):
    return WorkerInfo(job=job, rank=rank, local_rank=rank, world_size=2, mesh={"dp": 2}, pid=pid,
                      restart_count=restart_count, hostname="h")


def totals(count, wait, seq, op="all_reduce", pg="default_pg"):
    return [CollectiveTotals(process_group=pg, op=op, count=count, wait_seconds=wait, last_seq_id=seq)]


@pytest.mark.timeout(10)
def test_steps_aggregate_into_counters_histogram_and_percentiles():
    js = JobTelemetry(clock=FakeClock())
    js.connect(hello())
    for i, d in enumerate([0.1] * 98 + [1.0, 2.0]):
        js.record_step("j", 0, index=i, start_unix=1000.0 + i, duration_seconds=d, tokens=10)
    (job,) = js.snapshot()
    (r,) = job.ranks
    assert (r.last_step, r.step_count, r.tokens_total) == (99, 100, 1000)
    assert r.step_seconds_total == pytest.approx(9.8 + 3.0)
    assert sum(r.step_bucket_counts) == 100
    assert r.step_p50_seconds == pytest.approx(0.1) and r.step_p99_seconds == pytest.approx(1.0)
    assert r.tokens_per_second == pytest.approx(1000 / (99 + 2.0))
    assert job.mesh == {"dp": 2} and job.world_size == 2


@pytest.mark.timeout(10)
def test_the_steady_step_time_leaves_out_each_processs_first_steps_once_enough_others_are_in():
    """What the hang deadline follows: a 3 s first step (compilation, the restore's first batch) must not
    hold the deadline at 5 x 3 s for the next 256 steps of 0.3 s; but a job whose every step is long keeps
    its long deadline while its steady window fills."""
    js = JobTelemetry(clock=FakeClock())
    js.connect(hello())

    def steady():
        (job,) = js.snapshot()
        return job.ranks[0].steady_step_p99_seconds

    durations = [3.0, 0.4, 0.3, 0.3, 0.3]
    for i, d in enumerate(durations):
        js.record_step("j", 0, index=i, start_unix=1000.0 + i, duration_seconds=d)
    assert steady() == pytest.approx(3.0)  # two steady steps: not enough, all steps count
    js.record_step("j", 0, index=5, start_unix=1005.0, duration_seconds=0.35)
    assert steady() == pytest.approx(0.35)
    (job,) = js.snapshot()
    assert job.ranks[0].step_p99_seconds == pytest.approx(3.0)  # the plain p99 still shows it
    js.connect(hello(pid=11))  # a new worker process: its start-up is left out again
    for i, d in enumerate([2.0, 10.0, 10.0]):
        js.record_step("j", 0, index=i, start_unix=2000.0 + i, duration_seconds=d)
    assert steady() == pytest.approx(10.0)


@pytest.mark.timeout(10)
def test_steps_that_overlap_a_checkpoint_write_are_kept_out_of_the_steady_step_time():
    """The reference job's steps take 0.2-0.3 s, and 0.6-0.9 s while a background checkpoint write shares the host's
    cores: in the steady window those set the hang deadline (5 x 0.75 s) for every hang until they left it. The
    steps from a save's start to the step in which each rank's write ended go to their own window, and the
    snapshot says while the step in flight may overlap a write."""
    js = JobTelemetry(clock=FakeClock())
    for rank in (0, 1):
        js.connect(hello(rank=rank, pid=10 + rank))
    index = 0

    def step(duration, ranks=(0, 1)):
        nonlocal index
        for rank in ranks:
            js.record_step("j", rank, index=index, start_unix=1000.0 + index, duration_seconds=duration)
        index += 1

    def ranks():
        (job,) = js.snapshot()
        return job.ranks

    for _ in range(8):
        step(0.3)
    assert [r.write_pending for r in ranks()] == [False, False]
    for rank in (0, 1):
        js.record_checkpoint("j", rank, stage="save_start", step=8, seconds=0.0)
        js.record_checkpoint("j", rank, stage="staged", step=8, seconds=0.05)
    assert [r.write_pending for r in ranks()] == [True, True]
    step(0.9)
    step(0.8)
    js.record_checkpoint("j", 1, stage="written", step=8, seconds=1.5)
    assert [r.write_pending for r in ranks()] == [True, True]  # rank 0's write still runs: it slows rank 1 too
    step(0.85)
    js.record_checkpoint("j", 0, stage="written", step=8, seconds=1.8)
    js.record_checkpoint("j", 0, stage="committed", step=8, seconds=0.0)
    assert [r.write_pending for r in ranks()] == [True, True]  # the step in which it ended overlapped it
    step(0.7)
    assert [r.write_pending for r in ranks()] == [True, True]  # and the next: the commit, retention, publishing
    step(0.6)
    assert [r.write_pending for r in ranks()] == [False, False]
    step(0.3)
    r0, r1 = ranks()
    assert r0.steady_step_p99_seconds == pytest.approx(0.3) and r1.steady_step_p99_seconds == pytest.approx(0.3)
    assert r0.writing_step_p99_seconds == pytest.approx(0.9) and r0.step_p99_seconds == pytest.approx(0.9)

    # a synchronous save reports its write's end before `staged`: its step order says nothing is left in flight
    for stage in ("save_start", "written", "committed", "staged"):
        js.record_checkpoint("j", 0, stage=stage, step=12, seconds=0.0)
    step(1.2, ranks=(0,))
    step(0.5, ranks=(0,))
    step(0.3, ranks=(0,))
    assert ranks()[0].write_pending is False and ranks()[0].steady_step_p99_seconds == pytest.approx(0.3)

    # a runtime that never says `written` leaves the write in flight: all steps allow for it, as before the stage
    js.record_checkpoint("j", 1, stage="staged", step=16, seconds=0.0)
    for _ in range(3):
        step(0.3, ranks=(1,))
    assert ranks()[1].write_pending is True
    # until its worker process is replaced: the write ended with the old process
    js.connect(hello(rank=1, pid=21))
    step(0.3, ranks=(1,))
    assert ranks()[1].write_pending is False and ranks()[1].writing_step_p99_seconds == 0.0


@pytest.mark.timeout(10)
def test_cumulative_collectives_become_monotonic_counters_across_a_worker_restart():
    js = JobTelemetry(clock=FakeClock())
    js.connect(hello(pid=10))
    js.record_step("j", 0, index=0, start_unix=0, duration_seconds=10.0)
    js.record_collectives("j", 0, totals(5, 2.0, 5), has_durations=True)
    js.record_collectives("j", 0, totals(5, 2.0, 5), has_durations=True)  # a repeat counts nothing
    assert js.snapshot()[0].ranks[0].compute_seconds_total == pytest.approx(8.0)
    js.record_step("j", 0, index=1, start_unix=10, duration_seconds=2.0)
    js.record_collectives("j", 0, totals(8, 3.0, 8), has_durations=True)
    r = js.snapshot()[0].ranks[0]
    assert r.collectives[0].count == 8 and r.wait_seconds_by_op == {"all_reduce": pytest.approx(3.0)}
    assert r.compute_seconds_total == pytest.approx(9.0)

    js.connect(hello(rank=1, pid=20))
    js.connect(hello(rank=1, pid=21, restart_count=1))  # torchrun restarts every rank: one restart
    js.connect(hello(pid=11, restart_count=1))  # new process: its totals start from zero
    js.record_collectives("j", 0, totals(2, 0.5, 2), has_durations=True)
    job = js.snapshot()[0]
    r = job.ranks[0]
    assert r.collectives[0].count == 10 and r.collectives[0].last_seq_id == 2
    assert r.wait_seconds_by_op["all_reduce"] == pytest.approx(3.5)
    assert r.compute_seconds_total == pytest.approx(9.0)  # 12 - 3.5 = 8.5, but it never decreases
    assert job.restarts_total == 1


@pytest.mark.timeout(10)
def test_wait_share_uses_the_recent_window():
    js = JobTelemetry(clock=FakeClock())
    js.connect(hello())
    js.record_step("j", 0, index=0, start_unix=0, duration_seconds=10.0)
    js.record_collectives("j", 0, totals(1, 1.0, 1), has_durations=True)
    js.record_step("j", 0, index=1, start_unix=10, duration_seconds=10.0)
    js.record_collectives("j", 0, totals(2, 6.0, 2), has_durations=True)
    assert js.snapshot()[0].ranks[0].wait_share == pytest.approx(0.5)


@pytest.mark.timeout(10)
def test_disconnect_flags_and_prune():
    clock = FakeClock()
    js = JobTelemetry(clock=clock)
    js.connect(hello(rank=0, pid=10))
    js.connect(hello(rank=1, pid=11))
    js.set_flag("j", 1, "straggler")
    js.disconnect("j", 0, pid=999)  # a stale stream of an older process changes nothing
    assert js.snapshot()[0].ranks[0].connected
    js.disconnect("j", 0, pid=10)
    ranks = js.snapshot()[0].ranks
    assert ranks[0].flags == ("disconnected",) and ranks[1].flags == ("straggler",)
    assert js.prune(60) == []
    js.disconnect("j", 1, pid=11)
    clock.now += 61
    assert js.prune(60) == ["j"] and js.snapshot() == ()


@pytest.mark.timeout(10)
def test_checkpoints_rejections_and_unknown_ranks():
    js = JobTelemetry(clock=FakeClock())
    js.connect(hello())
    js.record_checkpoint("j", 0, stage="staged", step=10, seconds=0.25)
    js.record_checkpoint("j", 0, stage="committed", step=10, seconds=3.0)
    js.record_checkpoint("j", 0, stage="failed", step=20, seconds=1.0)
    with pytest.raises(ValueError, match="unknown checkpoint stage"):
        js.record_checkpoint("j", 0, stage="half-done", step=1, seconds=0)
    js.record_step("nope", 3, index=1, start_unix=0, duration_seconds=1)  # ignored, no error
    js.record_client_stats("j", 0, dropped=5)
    js.record_client_stats("j", 0, dropped=7)
    js.count_rejected("malformed")
    js.count_rejected("something else")
    job = js.snapshot()[0]
    assert (job.checkpoint_last_step, job.checkpoint_failures_total) == (10, 1)
    assert job.ranks[0].checkpoint_stall_seconds == 0.25 and job.ranks[0].dropped_total == 7
    assert job.ranks[0].checkpoint_stage == "failed"
    assert js.rejected()["malformed"] == 1 and js.rejected()["invalid"] == 1
    with pytest.raises(ValueError):
        JobTelemetry(recent_steps=1)


@pytest.mark.timeout(10)
def test_arrivals_become_intervals_and_a_new_round_starts_matching_afresh():
    from trainwarden.agent.telemetry.arrivals import Arrival

    js = JobTelemetry(clock=FakeClock())
    for r in (0, 1):
        js.connect(hello(rank=r, pid=10 + r))
    s = 1_000_000_000
    js.record_arrivals("j", 0, [Arrival("5", 0, 1 * s), Arrival("5", 1, 2 * s)], continues=False,
                       members={"5": [0, 1]})
    js.record_arrivals("j", 1, [Arrival("5", 0, 1 * s + s // 2), Arrival("5", 1, 2 * s)], continues=False)
    got = js.take_intervals("j")
    assert got[0][0].compute_ns == s // 2 and got[1][0].compute_ns == s // 2
    assert js.take_intervals("j") == {}        # taken once
    js.connect(hello(rank=0, pid=99))           # a new worker: sequence ids start again
    js.record_arrivals("j", 0, [Arrival("5", 1, 9 * s), Arrival("5", 2, 10 * s)], continues=False)
    assert js.take_intervals("j") == {}        # not matched against the old round's seq 1
    assert js.take_intervals("nope") == {}


@pytest.mark.timeout(10)
def test_measured_durations_give_one_interval_per_collectives_record():
    js = JobTelemetry(clock=FakeClock())
    js.connect(hello())
    for i in range(4):
        js.record_step("j", 0, index=i, start_unix=1000.0 + i, duration_seconds=1.0)
    js.record_collectives("j", 0, totals(4, 1.0, 4), has_durations=True)
    for i in range(4, 8):
        js.record_step("j", 0, index=i, start_unix=1000.0 + i, duration_seconds=1.0)
    js.record_collectives("j", 0, totals(8, 3.0, 8), has_durations=True)
    (interval,), = js.take_intervals("j").values()
    assert interval.total_ns == 4_000_000_000 and interval.compute_ns == 2_000_000_000
    assert interval.end_ns == 1_008_000_000_000


@pytest.mark.timeout(10)
def test_on_gloo_the_wait_is_the_matched_arrivals_not_the_enqueue_estimate():
    """A balanced job used to show WAIT 100 % for every rank: the enqueue-to-next-enqueue estimate counted a
    tensor-parallel rank's compute as waiting. On gloo the wait is departure - own arrival."""
    from trainwarden.agent.telemetry.arrivals import Arrival

    js = JobTelemetry(clock=FakeClock())
    for r in (0, 1):
        js.connect(hello(rank=r, pid=10 + r))
    members = {"g": [0, 1]}
    for step in range(10):
        start = 1000.0 + step * 0.1
        for r in (0, 1):
            js.record_step("j", r, index=step, start_unix=start, duration_seconds=0.1)
        # rank 1 arrives 10 ms after rank 0 at the step's one all-reduce: rank 0 waits 10 ms, rank 1 not at all
        for r, late in ((0, 0.0), (1, 0.01)):
            js.record_arrivals("j", r, [Arrival("g", step, int((start + 0.05 + late) * 1e9), "all_reduce")],
                               continues=step > 0, members=members)
        for r in (0, 1):  # the worker's own estimate claims the whole step was waiting: ignored on gloo
            js.record_collectives("j", r, totals(step + 1, 0.1 * (step + 1), step), has_durations=False)
    ranks = {r.rank: r for r in js.snapshot("j")[0].ranks}
    # 9 collectives resolved (the last waits for its successor): 9 x 10 ms for rank 0
    assert ranks[0].wait_seconds_by_op == {"all_reduce": pytest.approx(0.09, abs=1e-6)}
    assert ranks[1].wait_seconds_by_op == {"all_reduce": pytest.approx(0.0, abs=1e-6)}
    assert ranks[0].wait_share == pytest.approx(0.09, abs=0.02) and ranks[1].wait_share < 0.01
    assert ranks[0].compute_seconds_total == pytest.approx(1.0 - 0.09, abs=1e-6)


@pytest.mark.timeout(10)
def test_a_worker_cannot_grow_the_label_sets_without_bound():
    js = JobTelemetry()
    js.connect(hello())
    many = [CollectiveTotals(process_group=f"pg{i}", op=f"op{i}", count=1, wait_seconds=0.1, last_seq_id=1)
            for i in range(500)]
    js.record_collectives("j", 0, many, has_durations=True)
    (r,) = js.snapshot("j")[0].ranks
    assert len(r.collectives) == 64 and len(r.wait_seconds_by_op) == 33  # 32 ops, the rest in "other"
    assert js.overflow() == {"collective_keys": 436, "ops": 32}


@pytest.mark.timeout(10)
def test_a_job_belongs_to_the_uid_of_its_first_verified_stream_until_it_is_pruned():
    """Issue 30: one uid cannot take another's rank, nor a rank of its job that has no stream yet or is between
    two streams; an unverified stream never replaces a verified one. A refusal changes nothing."""
    from dataclasses import replace

    clock = FakeClock()
    js = JobTelemetry(clock=clock)
    mine = lambda rank=0, pid=10, uid=1000: replace(hello(rank=rank, pid=pid), verified=True, uid=uid)  # noqa: E731
    assert js.connect(mine()) is None
    js.record_step("j", 0, index=5, start_unix=1.0, duration_seconds=0.1, tokens=0)
    refusal = js.connect(mine(pid=66, uid=1001))
    assert refusal == "job j streams as uid 1000; a stream of uid 1001 may not speak for its rank 0"
    assert "uid 1001" in js.connect(mine(rank=1, pid=66, uid=1001))  # a rank with no stream yet
    assert "an unverified stream may not speak" in js.connect(hello(pid=66))
    (job,) = js.snapshot()
    assert [(r.rank, r.pid, r.last_step, r.verified) for r in job.ranks] == [(0, 10, 5, True)]

    js.disconnect("j", 0, 10)  # between two streams: still the job's uid's
    assert js.connect(mine(pid=66, uid=1001)) is not None
    assert js.connect(mine(pid=11)) is None  # the job's uid: a restarted worker takes its rank
    assert js.connect(mine(rank=1, pid=12)) is None
    js.disconnect("j", 0, 11)
    js.disconnect("j", 1, 12)
    clock.now += 601
    assert js.prune(600) == ["j"]
    assert js.connect(mine(pid=66, uid=1001)) is None  # forgotten: a new job of that name may be anyone's


@pytest.mark.timeout(10)
def test_unverified_streams_alone_have_no_owner_to_refuse():
    js = JobTelemetry(clock=FakeClock())
    assert js.connect(hello(pid=10)) is None and js.connect(hello(pid=11)) is None
    assert js.connect(hello(rank=1, pid=12)) is None


@pytest.mark.timeout(10)
def test_a_restored_rank_reports_the_step_it_resumed_from_the_same_on_an_agent_old_or_new():
    """Soak run D: a node's agent restarted and its node rejoined; the first step of the new round hung. The old
    agent's ranks said last step 1575 (seen in an earlier round), the new agent's -1, so the nodes named the hang
    differently (cluster_hang.hang_key) and each owned it. A rank that restored a step has finished that step,
    and not the ones after it that were lost: its last step is the restored one."""
    from trainwarden.agent.watchdog.cluster_hang import hang_key

    old, new = JobTelemetry(clock=FakeClock()), JobTelemetry(clock=FakeClock())
    old.connect(hello(rank=0, pid=10))
    for i in range(1560, 1581):  # trained to 1580 in the round before; the restart restores 1575 from memory
        old.record_step("j", 0, index=i, start_unix=1000.0 + i, duration_seconds=0.3)
    old.connect(hello(rank=0, pid=11, restart_count=1))
    new.connect(hello(rank=1, pid=20))
    for store, rank in ((old, 0), (new, 1)):
        store.record_checkpoint("j", rank, stage="restored", step=1575, seconds=0.2)
    keys = {hang_key(store.snapshot("j")[0]) for store in (old, new)}
    assert keys == {"1575"}
    old.record_step("j", 0, index=1576, start_unix=3000.0, duration_seconds=0.3)
    assert old.snapshot("j")[0].ranks[0].last_step == 1576

"""Flight Recorder reading and reduction, on sample dicts shaped like torch 2.13's `_dump_fr_trace()`."""

import pickle

import pytest

from trainwarden.runtime.flight_recorder import FLIGHT_RECORDER_ENV, CollectiveReducer, FlightRecorder

MS = 1_000_000
T0 = 1_795_356_347_000_000_000  # wall-clock ns, as the recorder stores them


def entry(record_id, created_ms, name="gloo:all_reduce", pg=("0", "default_pg"), seq=None, retired=True,
          thread="140588942891904", **extra):
    e = {"record_id": record_id, "pg_id": int(pg[0]), "process_group": pg, "thread_name": "python3",
         "thread_id": thread, "collective_seq_id": seq if seq is not None else record_id + 1, "p2p_seq_id": 0,
         "op_id": record_id + 1, "profiling_name": name, "time_created_ns": T0 + created_ms * MS,
         "input_sizes": [[1000]], "state": "scheduled", "time_discovered_started_ns": None,
         "time_discovered_completed_ns": None, "retired": retired, "timeout_ms": 1800000, "is_p2p": False}
    e.update(extra)
    return e


class FakeDump:
    def __init__(self):
        self.entries = []

    def __call__(self, include_stack_traces):
        return pickle.dumps({"version": "2.10", "pg_config": {}, "pg_status": {}, "entries": list(self.entries)})


def by_key(summaries):
    return {(s.process_group, s.op): s for s in summaries}


@pytest.mark.timeout(10)
def test_reader_returns_each_retired_entry_once_and_counts_overwritten_ones():
    dump = FakeDump()
    fr = FlightRecorder(dump)
    dump.entries = [entry(0, 0), entry(1, 5), entry(2, 9, retired=False)]
    assert [e["record_id"] for e in fr.read_new()] == [0, 1]
    assert fr.read_new() == []
    dump.entries[2] = entry(2, 9)
    dump.entries.append(entry(3, 12))
    assert [e["record_id"] for e in fr.read_new()] == [2, 3]
    dump.entries = [entry(i, i) for i in range(10, 14)]  # ring of 4 wrapped: ids 4..9 were overwritten
    assert [e["record_id"] for e in fr.read_new()] == [10, 11, 12, 13]
    assert fr.missed == 6


@pytest.mark.timeout(10)
def test_absent_recorder_is_harmless():
    fr = FlightRecorder(dump=None)
    fr._dump = None  # as when torch lacks _dump_fr_trace
    assert not fr.available and fr.read_new() == [] and fr.dump_raw() is None


@pytest.mark.timeout(10)
def test_gloo_wait_is_the_gap_to_the_next_enqueue_or_the_step_end():
    reducer = CollectiveReducer()
    reducer.add_step(T0 + 0 * MS, T0 + 100 * MS)
    reducer.add_entries([
        entry(0, -50, name="gloo:barrier"),  # before the first step: counted, no wait
        entry(1, 10),
        entry(2, 40, name="gloo:broadcast", pg=("1", "undefined"), seq=1),
        entry(3, 90),
        entry(4, 120),  # in a step that has not ended yet: pending
    ])
    s = by_key(reducer.summaries())
    assert s[("default_pg", "barrier")].count == 1 and s[("default_pg", "barrier")].wait_seconds == 0
    assert s[("default_pg", "all_reduce")].count == 2
    assert s[("default_pg", "all_reduce")].wait_seconds == pytest.approx(0.030 + 0.010)
    assert s[("default_pg", "all_reduce")].last_seq_id == 4
    assert s[("pg1", "broadcast")].wait_seconds == pytest.approx(0.050)
    assert not reducer.has_durations

    reducer.add_step(T0 + 100 * MS, T0 + 200 * MS)
    s = by_key(reducer.summaries())
    assert s[("default_pg", "all_reduce")].count == 3
    assert s[("default_pg", "all_reduce")].wait_seconds == pytest.approx(0.040 + 0.080)
    assert s[("default_pg", "all_reduce")].last_seq_id == 5


@pytest.mark.timeout(10)
def test_threads_are_separate_timelines():
    reducer = CollectiveReducer()
    reducer.add_step(T0, T0 + 100 * MS)
    reducer.add_entries([entry(0, 10, thread="a"), entry(1, 20, thread="b"), entry(2, 60, thread="a")])
    assert by_key(reducer.summaries())[("default_pg", "all_reduce")].wait_seconds == pytest.approx(
        0.050 + 0.080 + 0.040)


@pytest.mark.timeout(10)
def test_slow_peer_shows_up_as_wait_on_the_fast_rank():
    # rank 0 computes 20 ms then all-reduces and waits for rank 1, which computed 80 ms
    fast, slow = CollectiveReducer(), CollectiveReducer()
    for step in range(5):
        base = step * 100
        fast.add_step(T0 + base * MS, T0 + (base + 100) * MS)
        slow.add_step(T0 + base * MS, T0 + (base + 100) * MS)
        fast.add_entries([entry(step, base + 20)])
        slow.add_entries([entry(step, base + 80)])
    wait_fast = fast.summaries()[0].wait_seconds
    wait_slow = slow.summaries()[0].wait_seconds
    assert wait_fast == pytest.approx(5 * 0.080) and wait_slow == pytest.approx(5 * 0.020)


@pytest.mark.timeout(10)
def test_nccl_durations_are_used_when_present():
    reducer = CollectiveReducer()
    reducer.add_entries([entry(0, 10, name="nccl:all_reduce", duration_ms=12.5, state="completed"),
                         entry(1, 30, name="nccl:all_gather", duration_ms=2.0, state="completed")])
    s = by_key(reducer.summaries())
    assert reducer.has_durations
    assert s[("default_pg", "all_reduce")].wait_seconds == pytest.approx(0.0125)
    assert s[("default_pg", "all_gather")].count == 1


@pytest.mark.timeout(10)
def test_launcher_environment_enables_the_recorder():
    assert int(FLIGHT_RECORDER_ENV["TORCH_FR_BUFFER_SIZE"]) > 0


def _arrival(rid, seq, t, *, pg="7", thread="11", p2p=False):
    return {"record_id": rid, "process_group": (pg, "mesh_tp"), "collective_seq_id": seq, "thread_id": thread,
            "time_created_ns": t, "is_p2p": p2p, "profiling_name": "gloo:all_reduce"}


def test_arrival_log_keeps_the_training_threads_collectives_in_record_order():
    from trainwarden.runtime.flight_recorder import ArrivalLog

    log = ArrivalLog(11, members=lambda name: (0, 1) if name == "7" else None)
    batch = log.add([_arrival(0, 0, 100), _arrival(2, 1, 300), _arrival(1, 0, 200, pg="9", thread="12"),
                     _arrival(3, 0, 400, p2p=True)], complete_below=4, missed=0)
    assert batch.arrivals == (("7", 0, 100, "all_reduce"), ("7", 1, 300, "all_reduce"))
    assert batch.members == {"7": (0, 1)} and batch.continues is False
    # record 5 retired before record 4: it is held back until 4 is read
    batch = log.add([_arrival(5, 3, 600)], complete_below=4, missed=0)
    assert batch.arrivals == () and batch.members == {}
    batch = log.add([_arrival(4, 2, 500)], complete_below=6, missed=0)
    assert batch.arrivals == (("7", 2, 500, "all_reduce"), ("7", 3, 600, "all_reduce")) and batch.continues is True


def test_arrival_log_marks_a_gap_when_entries_were_missed():
    from trainwarden.runtime.flight_recorder import ArrivalLog

    log = ArrivalLog(11, members=lambda name: None)
    assert log.add([_arrival(0, 0, 100)], complete_below=1, missed=0).continues is False
    assert log.add([_arrival(1, 1, 200)], complete_below=2, missed=0).continues is True
    batch = log.add([_arrival(9, 9, 900)], complete_below=10, missed=7)
    assert batch.arrivals == (("7", 9, 900, "all_reduce"),) and batch.continues is False and batch.members == {}
    assert log.add([_arrival(10, 10, 1000)], complete_below=11, missed=7).continues is True


def _schedule(**kw):
    from trainwarden.runtime.flight_recorder import ReadSchedule

    args = dict(interval_s=1.5, min_interval_s=0.5, max_duty=0.002, capacity=256)
    args.update(kw)
    return ReadSchedule(**args)


@pytest.mark.timeout(10)
def test_a_slow_filling_ring_is_read_every_interval_on_the_wall_clock_grid():
    s = _schedule()
    assert s.next_read(100.2) == 100.5  # first read: the next multiple of the longest period
    t = s.next_read(100.5, cost_s=0.001, entries=6)  # 20 collectives a second: the ring lasts 12 s
    assert (t, s.period_s) == (102.0, 1.5)


@pytest.mark.timeout(10)
def test_a_fast_filling_ring_is_read_before_it_wraps():
    s = _schedule()
    s.next_read(0.0)
    s.next_read(1.5, cost_s=0.0005)
    # 300 new entries a second fill a 256-entry ring in 0.85 s: read every 0.5 s (75 % of it, rounded down to the grid)
    assert s.next_read(3.0, cost_s=0.0005, entries=450) == 3.5 and s.period_s == 0.5
    # the rate falls: the next period follows the highest of the last three rates, then relaxes
    s.next_read(3.5, cost_s=0.0005, entries=10)
    s.next_read(4.0, cost_s=0.0005, entries=10)
    assert s.next_read(4.5, cost_s=0.0005, entries=10) == 6.0 and s.period_s == 1.5


@pytest.mark.timeout(10)
def test_reads_that_cost_more_than_the_duty_allows_are_spaced_out_and_the_ring_sampled():
    s = _schedule()
    s.next_read(0.0)
    # a 10 ms read at 0.2 % duty: at most one every 5 s, rounded up to the grid; the ring (256 entries
    # at 1,000 a second) then holds a quarter of a second of every six: sampled
    assert s.next_read(1.5, cost_s=0.010, entries=1500) == 6.0 and s.period_s == 6.0
    # a fast ring whose reads are cheap enough is read at the floor, not faster
    s = _schedule(capacity=64)
    s.next_read(0.0)
    assert s.next_read(1.5, cost_s=0.0002, entries=3000) == 2.0 and s.period_s == 0.5


@pytest.mark.timeout(10)
def test_ranks_that_see_the_same_rate_read_at_the_same_instants():
    a, b = _schedule(), _schedule()
    a.next_read(10.0), b.next_read(10.3)
    # their reads fall at different moments within a period (each thread wakes late by its own amount)
    assert a.next_read(10.52, cost_s=0.0005, entries=12) == b.next_read(10.61, cost_s=0.0006, entries=13)


@pytest.mark.timeout(10)
def test_the_agents_read_pace_lengthens_the_period_within_the_rings_coverage():
    s = _schedule()
    s.next_read(0.0)
    s.next_read(1.5, cost_s=0.001, entries=30)  # 20 collectives a second: the ring lasts 12.8 s
    # asked for 3 s: the next read on the 3 s grid (the caller keeps a sooner one it had planned)
    assert s.set_interval(3.0, 2.2) == 3.0 and s.period_s == 3.0
    assert s.next_read(3.0, cost_s=0.001, entries=30) == 6.0
    # asked for 30 s: coverage still bounds it (75 % of 12.8 s, rounded down to the grid)
    assert s.set_interval(30.0, 6.1) == 8.0 and s.period_s == 8.0
    # back to the worker's own pace, and never below the floor
    assert s.set_interval(1.5, 6.1) == 7.5 and s.period_s == 1.5
    assert s.set_interval(0.1, 6.1) == 6.5 and s.period_s == 0.5


@pytest.mark.timeout(10)
def test_ring_capacity_comes_from_the_environment():
    from trainwarden.runtime.flight_recorder import ring_capacity

    assert ring_capacity({"TORCH_FR_BUFFER_SIZE": "256"}) == 256
    assert ring_capacity({"TORCH_NCCL_TRACE_BUFFER_SIZE": "64"}) == 64
    assert ring_capacity({}) is None and ring_capacity({"TORCH_FR_BUFFER_SIZE": "lots"}) is None

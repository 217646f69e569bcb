"""Flight Recorder reading and reduction, on sample dicts shaped like torch 2.13's `_dump_fr_trace()` and
`_dump_nccl_trace()` (the keys FlightRecorder<EventType>::getCollectiveTrace inserts, checked against torch's
own analyzer type `EntryState`), and on the gloo recorder of a real one-rank run."""

import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

from trainwarden.runtime.flight_recorder import FLIGHT_RECORDER_ENV, ArrivalLog, CollectiveReducer, FlightRecorder

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
def test_trainwardens_own_background_traffic_is_never_read_as_the_jobs():
    """The peer copy of memory snapshots (runtime/checkpoint/memory_peer.py) sends and receives on a group of its own; a
    receive waiting for the next snapshot is pending for a whole step and must not count as a collective."""
    dump = FakeDump()
    fr = FlightRecorder(dump)
    copy = ("7", "trainwarden-peer-copy")
    dump.entries = [entry(0, 0), entry(1, 1, name="gloo:send", pg=copy, is_p2p=True),
                    entry(2, 2, name="gloo:recv", pg=copy, is_p2p=True, retired=False, thread="9")]
    assert [e["record_id"] for e in fr.read_new()] == [0]
    assert fr.oldest_pending_ns() is None and fr.oldest_pending_ns(thread_id=9) is None
    dump.entries[2] = entry(2, 2, name="gloo:recv", pg=copy, is_p2p=True)
    dump.entries.append(entry(3, 3))
    assert [e["record_id"] for e in fr.read_new()] == [3] and fr.missed == 0


@pytest.mark.timeout(10)
def test_absent_recorder_is_harmless():
    fr = FlightRecorder(recorders={})  # as when torch has neither _dump_fr_trace nor _dump_nccl_trace
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


# ---- NCCL's recorder (FlightRecorderCUDA, `_dump_nccl_trace`) ----------------------------------------------

def nccl_entry(record_id, created_ms, *, seq, pg=("group_name_0", ""), name="nccl:all_reduce", state="completed",
               started_ms=None, completed_ms=None, duration_ms=None, retired=True, thread="140588942891904"):
    """One entry as FlightRecorder<CUDAEvent>::getCollectiveTrace writes it (torch 2.13,
    FlightRecorderDetail.hpp): `duration_ms` only when timing is on, the discovery times None until seen."""
    e = {"record_id": record_id, "pg_id": 0, "process_group": pg, "thread_name": "pt_main_thread",
         "thread_id": thread, "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "profiling_name": name,
         "time_created_ns": T0 + created_ms * MS, "input_sizes": [[3, 4]], "input_dtypes": ["Float"],
         "output_sizes": [[3, 4]], "output_dtypes": ["Float"], "state": state,
         "time_discovered_started_ns": None if started_ms is None else T0 + started_ms * MS,
         "time_discovered_completed_ns": None if completed_ms is None else T0 + completed_ms * MS,
         "retired": retired, "timeout_ms": 600000, "is_p2p": False}
    if duration_ms is not None:
        e["duration_ms"] = duration_ms
    return e


def nccl_trace(entries):
    return pickle.dumps({"version": "2.10", "pg_config": {"group_name_0": {"name": "group_name_0", "desc": "",
                                                                           "ranks": "[0, 1]"}},
                         "comm_lib_version": "2.27.5", "pg_status": {"0": {"last_enqueued_collective": 3,
                                                                          "last_started_collective": 2,
                                                                          "last_completed_collective": 2}},
                         "entries": entries, "nccl_comm_state": {}})


def test_nccl_fixtures_are_read_by_torchs_own_analyzer_types():
    from torch.distributed.flight_recorder.components.types import EntryState

    for e in (nccl_entry(0, 0, seq=1, started_ms=5, completed_ms=9, duration_ms=3.5),
              nccl_entry(1, 1, seq=2, state="started", started_ms=6, retired=False)):
        state = EntryState(e, {0, 1})
        assert (state.pg_name, state.collective_state, state.record_id) == (
            e["process_group"][0], e["state"], e["record_id"])


@pytest.mark.timeout(10)
def test_each_backends_recorder_is_read_on_its_own_ring():
    gloo, nccl = FakeDump(), []
    fr = FlightRecorder(recorders={"gloo": gloo, "nccl": lambda stacks: nccl_trace(list(nccl))})
    gloo.entries = [entry(0, 0), entry(1, 5)]
    nccl[:] = [nccl_entry(0, 1, seq=1, started_ms=2, completed_ms=8, duration_ms=4.0),
               nccl_entry(1, 3, seq=2, state="started", started_ms=9, retired=False)]  # in flight on the GPU
    got = fr.read_new()
    assert sorted((e["recorder"], e["record_id"]) for e in got) == [("gloo", 0), ("gloo", 1), ("nccl", 0)]
    assert fr.complete_below == {"gloo": 2, "nccl": 1}
    # the in-flight NCCL collective completes (the watchdog discovered it): returned once, the ids overlap gloo's
    nccl[1] = nccl_entry(1, 3, seq=2, started_ms=9, completed_ms=15, duration_ms=5.0)
    assert [(e["recorder"], e["record_id"]) for e in fr.read_new()] == [("nccl", 1)]
    assert fr.read_new() == [] and fr.missed == 0 and fr.returned == 4


@pytest.mark.timeout(10)
def test_an_nccl_entry_completed_before_retirement_waits_one_read_for_its_duration():
    # a dump's own event query may say "completed" before the watchdog retires the entry, and retirement is
    # what adds duration_ms: read at once on an H100, the last entries of a burst had none
    nccl = [nccl_entry(0, 0, seq=1, completed_ms=4, retired=False), nccl_entry(1, 1, seq=2, completed_ms=5,
                                                                              retired=False)]
    fr = FlightRecorder(recorders={"nccl": lambda stacks: nccl_trace(list(nccl))})
    assert fr.read_new() == [] and fr.complete_below == {"nccl": 0}
    nccl[0] = nccl_entry(0, 0, seq=1, completed_ms=4, duration_ms=2.5)  # retired by the watchdog meanwhile
    got = fr.read_new()
    assert [(e["record_id"], e.get("duration_ms")) for e in got] == [(0, 2.5), (1, None)]  # 1: never retired
    assert fr.read_new() == [] and fr.complete_below == {"nccl": 2}


@pytest.mark.timeout(10)
def test_a_failing_recorder_does_not_hide_the_other():
    def broken(stacks):
        raise RuntimeError("NCCL dump failed")

    gloo = FakeDump()
    gloo.entries = [entry(0, 0)]
    fr = FlightRecorder(recorders={"nccl": broken, "gloo": gloo})
    assert [e["recorder"] for e in fr.read_new()] == ["gloo"]


@pytest.mark.timeout(10)
def test_nccl_wait_is_the_measured_duration_or_the_discovered_span_never_the_enqueue_gap():
    reducer = CollectiveReducer()
    reducer.add_step(T0, T0 + 100 * MS)
    reducer.add_entries([
        dict(nccl_entry(0, 1, seq=1, started_ms=30, completed_ms=60, duration_ms=25.0), recorder="nccl"),
        # timing off: no duration; the discovered span stands in (state went started -> completed)
        dict(nccl_entry(1, 2, seq=2, name="nccl:all_gather", started_ms=61, completed_ms=70), recorder="nccl"),
        # timing off and the start never seen: zero, not the 1 ms -> step end gap of CPU enqueues
        dict(nccl_entry(2, 3, seq=3, name="nccl:broadcast", completed_ms=80), recorder="nccl"),
    ])
    s = by_key(reducer.summaries())
    assert s[("group_name_0", "all_reduce")].wait_seconds == pytest.approx(0.025)
    assert s[("group_name_0", "all_gather")].wait_seconds == pytest.approx(0.009)
    assert s[("group_name_0", "broadcast")].wait_seconds == 0.0 and s[("group_name_0", "broadcast")].count == 1
    assert reducer.has_durations


def test_nccl_arrivals_are_the_kernels_start_not_the_cpu_enqueue():
    log = ArrivalLog(140588942891904, members=lambda name: None)
    fr = FlightRecorder(recorders={"nccl": lambda stacks: nccl_trace([
        # enqueued at 1 ms by a CPU running ahead; the kernel ran 40 ms -> 44 ms (completion seen at 44 ms)
        nccl_entry(0, 1, seq=1, started_ms=44, completed_ms=44, duration_ms=4.0),
        # timing off: only the enqueue time is known
        nccl_entry(1, 2, seq=2, completed_ms=50)])})
    batch = log.add(fr.read_new(), complete_below=fr.complete_below, missed=fr.missed)
    assert batch.arrivals == (("group_name_0", 1, T0 + 40 * MS, "all_reduce"),
                              ("group_name_0", 2, T0 + 2 * MS, "all_reduce"))


def test_arrivals_of_two_recorders_merge_in_enqueue_order_and_wait_per_recorder():
    thread = "140588942891904"
    gloo, nccl = FakeDump(), []
    fr = FlightRecorder(recorders={"gloo": gloo, "nccl": lambda stacks: nccl_trace(list(nccl))})
    log = ArrivalLog(int(thread), members=lambda name: None)
    gloo.entries = [entry(0, 10, pg=("5", "cpu_pg"), seq=1, thread=thread)]
    nccl[:] = [nccl_entry(0, 5, seq=1, completed_ms=9), nccl_entry(1, 20, seq=2, retired=False, state="scheduled")]
    batch = log.add(fr.read_new(), complete_below=fr.complete_below, missed=fr.missed)
    assert [(a[0], a[1]) for a in batch.arrivals] == [("group_name_0", 1), ("5", 1)]
    nccl[1] = nccl_entry(1, 20, seq=2, completed_ms=30)
    batch = log.add(fr.read_new(), complete_below=fr.complete_below, missed=fr.missed)
    assert [(a[0], a[1]) for a in batch.arrivals] == [("group_name_0", 2)] and batch.continues


def test_a_diagnostics_dump_of_two_recorders_is_one_trace_with_every_entry():
    from trainwarden.agent.watchdog.culprit import positions_from_trace

    gloo = FakeDump()
    gloo.entries = [entry(0, 10, pg=("5", "cpu_pg"), seq=4)]
    fr = FlightRecorder(recorders={"gloo": gloo, "nccl": lambda stacks: nccl_trace([
        nccl_entry(0, 5, seq=7, state="started", started_ms=6, retired=False)])})
    trace = pickle.loads(fr.dump_raw())
    assert sorted(e["recorder"] for e in trace["entries"]) == ["gloo", "nccl"]
    assert "nccl_comm_state" in trace and set(trace["pg_status"]) == {"nccl/0"}
    assert sorted(e["pg_id"] for e in trace["entries"]) == ["gloo/5", "nccl/0"]
    positions = positions_from_trace(trace)
    assert positions["group_name_0"].seq == 7 and positions["group_name_0"].in_flight
    assert positions["5"].seq == 4
    # one recorder holding entries: its dump, byte for byte
    only_gloo = FlightRecorder(recorders={"gloo": gloo, "nccl": lambda stacks: nccl_trace([])})
    assert only_gloo.dump_raw() == gloo(False)


_REAL_GLOO_RUN = textwrap.dedent("""
    import json, os, sys, tempfile, time
    import torch, torch.distributed as dist
    from trainwarden.runtime.flight_recorder import FlightRecorder, torch_recorders
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    fr = FlightRecorder()
    x = torch.ones(4)
    dist.all_reduce(x)
    dist.broadcast(x, 0)
    got, deadline = fr.read_new(), time.monotonic() + 10
    while len(got) < 2 and time.monotonic() < deadline:  # gloo's worker thread retires an entry just after the
        time.sleep(0.05)                                  # call returns: under load, a later read returns it
        got += fr.read_new()
    print(json.dumps({"recorders": sorted(torch_recorders()), "entries": got}))
    dist.destroy_process_group()
""")


@pytest.mark.timeout(120)
def test_the_gloo_recorder_of_a_real_run_is_read():
    env = dict(os.environ, TORCH_FR_BUFFER_SIZE="64")
    out = subprocess.run([sys.executable, "-c", _REAL_GLOO_RUN], env=env, capture_output=True, text=True,
                         timeout=100, start_new_session=True)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # a CPU build of torch has the generic recorder only; a CUDA build adds NCCL's
    assert "gloo" in result["recorders"]
    got = [(e["recorder"], e["profiling_name"], e["collective_seq_id"]) for e in result["entries"]]
    assert got == [("gloo", "gloo:all_reduce", 1), ("gloo", "gloo:broadcast", 2)]
    reducer = CollectiveReducer()
    reducer.add_entries(result["entries"])  # no step recorded: gloo entries wait for one, none are NCCL
    assert not reducer.has_durations

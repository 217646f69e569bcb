import faulthandler
import os
import pickle
import sys
import threading
import time

import pytest

from trainwarden.agent.etcd.cluster import merge_verdicts
from trainwarden.agent.watchdog.culprit import (GroupPosition, RankEvidence, main_thread_frames, name_culprit,
                                       positions_from_trace, read_diagnostics, waits_in_p2p)

pytestmark = pytest.mark.timeout(30)


def _pos(group, seq, op="all_reduce", in_flight=False, desc=None):
    return GroupPosition(group=group, desc=desc or group, seq=seq, op=op,
                         in_flight=in_flight)


def _ev(rank, *positions, stack=(), status="answered"):
    return RankEvidence(rank=rank, status=status, positions={p.group: p for p in positions}, stack=stack)


def _mesh_3d_hang():
    """pp=2 x dp=2 x tp=2 (pp outermost). Rank 5 stopped outside any collective at the start of a step:
    its tp peer 4, its dp peer 7 and its pp peer 1 wait for it; rank 4's pp peer 0 and dp peer 6 wait for
    rank 4 (blocked in tp2), and so on."""
    return {
        0: _ev(0, _pos("tp0", 11), _pos("dp0", 31), _pos("pp0/p2p", 21, "send", True)),
        1: _ev(1, _pos("tp0", 11), _pos("dp1", 31), _pos("pp1/p2p", 21, "send", True)),
        2: _ev(2, _pos("tp1", 11), _pos("dp0", 31), _pos("pp2/p2p", 21, "send", False)),
        3: _ev(3, _pos("tp1", 11), _pos("dp1", 31), _pos("pp3/p2p", 21, "send", False)),
        4: _ev(4, _pos("tp2", 11, in_flight=True), _pos("dp2", 30), _pos("pp0/p2p", 20, "recv")),
        5: _ev(5, _pos("tp2", 10), _pos("dp3", 30), _pos("pp1/p2p", 20, "recv"),
               stack=("hang (runtime/faults.py:120)", "train (train.py:40)")),
        6: _ev(6, _pos("tp3", 11), _pos("dp2", 31, in_flight=True), _pos("pp2/p2p", 21, "recv")),
        7: _ev(7, _pos("tp3", 11), _pos("dp3", 31, in_flight=True), _pos("pp3/p2p", 21, "recv")),
    }


def test_names_the_rank_that_never_entered_the_collective_in_a_3d_mesh():
    verdict = name_culprit(_mesh_3d_hang())
    assert verdict.culprits == (5,)
    culprit_lags = {g.group: g for g in verdict.lags if g.rank == 5}
    assert set(culprit_lags) == {"tp2", "dp3", "pp1/p2p"}
    tp = culprit_lags["tp2"]
    assert (tp.seq, tp.peer_seq, tp.op, tp.waiting, tp.blocked) == (10, 11, "all_reduce", (4,), False)
    # rank 4 lags in its pp and dp groups only because it waits for rank 5 in tp2
    assert {g.rank for g in verdict.lags if g.blocked} == {4}
    assert verdict.stacks == {5: ("hang (runtime/faults.py:120)", "train (train.py:40)")}
    assert "rank 5 never entered" in verdict.summary and "hang (runtime/faults.py:120)" in verdict.summary
    d = verdict.to_dict()
    assert d["culprits"] == [5] and d["stacks"]["5"][0].startswith("hang")


def test_no_lagging_rank_is_said_not_guessed():
    evidence = {r: _ev(r, _pos("default_pg", 7, in_flight=True)) for r in range(4)}
    verdict = name_culprit(evidence)
    assert verdict.culprits == () and verdict.lags == ()
    assert verdict.summary == "no lagging rank: every rank is inside the same collective"


def test_unresponsive_ranks_are_recorded_as_such():
    evidence = {r: _ev(r, _pos("default_pg", 7, in_flight=True)) for r in (0, 2, 3)}
    evidence[1] = RankEvidence(rank=1, status="stopped")
    verdict = name_culprit(evidence)
    assert verdict.culprits == (1,)  # the others all wait in #7: the stopped rank never entered it
    assert verdict.unresponsive == {1: "stopped"}
    assert "rank 1 is stopped" in verdict.summary and "ranks 0,2,3 wait in" in verdict.summary


def test_lagging_ranks_that_all_wait_elsewhere_point_at_the_rank_that_did_not_answer():
    # rank 2 (the root) did not answer; rank 1 waits for it in group b and so lags in group a: every answering
    # rank waits inside a collective, so the dead rank is the one that never entered
    evidence = {0: _ev(0, _pos("a", 5, in_flight=True)),
                1: _ev(1, _pos("a", 4), _pos("b", 9, in_flight=True)),
                2: RankEvidence(rank=2, status="dead")}
    verdict = name_culprit(evidence)
    assert verdict.culprits == (2,)
    assert [(g.rank, g.blocked) for g in verdict.lags] == [(1, True)]
    assert verdict.summary.startswith("rank 2 is dead (its process is gone) and never entered"), verdict.summary


def test_without_an_unanswering_rank_lagging_blocked_ranks_are_not_named():
    evidence = {0: _ev(0, _pos("a", 5, in_flight=True)), 1: _ev(1, _pos("a", 4), _pos("b", 9, in_flight=True))}
    verdict = name_culprit(evidence)
    assert verdict.culprits == () and "cause is outside the answering ranks" in verdict.summary


def test_ranks_behind_in_a_collective_nobody_waits_in_are_not_named():
    """Seen in the soak (seed 30, n0 of a pipeline job): rank 7 on n1 was SIGSTOPped; on n0, ranks 2 and 3 were at
    #37 of a group whose leaders (ranks 0, 1) had done #41 and were inside no collective of it, while 2 and 3 waited
    for a pipeline receive (`_wait_batch_p2p`, which gloo's recorder does not show as a wait). The hang named
    ranks 2, 3 and 7; only 7 (n1's verdict) was the culprit."""
    evidence = {0: _ev(0, _pos("13", 41, "unknown", desc="undefined"), _pos("mesh_tp", 543, in_flight=True)),
                1: _ev(1, _pos("13", 41, "unknown", desc="undefined"), _pos("mesh_tp", 543, in_flight=True)),
                2: _ev(2, _pos("13", 37, "unknown", desc="undefined"), _pos("mesh_tp", 543),
                       stack=("_wait_batch_p2p (torch/distributed/pipelining/schedules.py:683)",)),
                3: _ev(3, _pos("13", 37, "unknown", desc="undefined"), _pos("mesh_tp", 543),
                       stack=("_wait_batch_p2p (torch/distributed/pipelining/schedules.py:683)",))}
    verdict = name_culprit(evidence)
    assert verdict.culprits == ()
    assert "cause is outside the answering ranks" in verdict.summary


def test_a_stopped_rank_in_a_single_group_job_is_named_in_plain_words():
    """The DDP shape: one all-reduce group, ranks 0,1,3 inside all_reduce #41, rank 2 stopped."""
    evidence = {r: _ev(r, _pos("default_pg", 41, in_flight=True)) for r in (0, 1, 3)}
    evidence[2] = RankEvidence(rank=2, status="stopped")
    verdict = name_culprit(evidence)
    assert verdict.culprits == (2,)
    assert verdict.summary == ("rank 2 is stopped (SIGSTOP, a debugger or a frozen container holds it) and never "
                               "entered all_reduce #41 of group default_pg, which ranks 0,1,3 wait in")


def test_without_flight_recorder_data_nothing_is_named():
    verdict = name_culprit({0: _ev(0), 1: _ev(1)})
    assert verdict.culprits == () and "no collective positions" in verdict.summary
    assert "no Flight Recorder dump arrived" in verdict.summary


def test_dumps_without_a_collective_are_not_called_missing():
    """Seen in tests/integration/test_unchanged_scripts.py: a GPipe schedule on gloo, rank 1 stopped; rank 0's
    dump arrived but held nothing (gloo's recorder has no entry for send/recv), and the verdict said no dump
    arrived and blamed the recorder's settings."""
    verdict = name_culprit({0: RankEvidence(rank=0, recorded=True), 1: RankEvidence(rank=1, status="stopped")})
    assert verdict.culprits == () and verdict.unresponsive == {1: "stopped"}
    assert verdict.summary == ("no collective positions: the Flight Recorder dumps of the 1 answering ranks hold "
                               "no collective (none entered yet, or only send/recv, which gloo does not record: a "
                               "pipeline schedule's traffic); ranks that did not answer: 1 (stopped)")


def test_all_ranks_outside_collectives_at_the_same_position():
    verdict = name_culprit({r: _ev(r, _pos("default_pg", 7)) for r in range(2)})
    assert verdict.culprits == () and "outside any collective" in verdict.summary


def _entry(rid, pg, seq, *, retired=True, op="gloo:all_reduce", p2p=False):
    # the shape of a torch 2.13 gloo Flight Recorder entry (fields trimmed)
    return {"record_id": rid, "pg_id": int(pg[0]), "process_group": pg, "collective_seq_id": 0 if p2p else seq,
            "p2p_seq_id": seq if p2p else 0, "profiling_name": op, "state": "scheduled", "retired": retired,
            "is_p2p": p2p, "time_created_ns": 1_000 + rid, "frames": []}


def test_positions_from_a_flight_recorder_trace():
    trace = {"version": "2.10", "entries": [
        _entry(0, ("0", "default_pg"), 1), _entry(1, ("1", "tp"), 1), _entry(2, ("0", "default_pg"), 2),
        _entry(3, ("1", "tp"), 2), _entry(4, ("0", "default_pg"), 3, retired=False),
        _entry(5, ("2", "pp"), 4, op="gloo:send", p2p=True), _entry(6, ("3", "dp"), 5)],
        # keyed by pg_id, a per-process ordinal: "9" is a group no entry names (ignored)
        "pg_status": {"0": {"last_enqueued_collective": 3, "last_completed_collective": 2},
                      "3": {"last_enqueued_collective": 6, "last_completed_collective": 5},
                      "9": {"last_enqueued_collective": 7, "last_completed_collective": 7}}}
    pos = positions_from_trace(trace)
    assert pos["0"] == GroupPosition(group="0", desc="default_pg", seq=3, op="all_reduce", in_flight=True)
    assert pos["1"].seq == 2 and not pos["1"].in_flight and pos["1"].desc == "tp"
    assert pos["2/p2p"].seq == 4 and pos["2/p2p"].op == "send"
    assert pos["3"].seq == 6 and pos["3"].in_flight and pos["3"].desc == "dp"  # newer in pg_status
    assert set(pos) == {"0", "1", "2/p2p", "3"}


def _parked(ident, name, depth=3, timeout=5.0):
    """Wait until thread `ident` is blocked with `name` among its top `depth` frames."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        frame, names = sys._current_frames().get(ident), []
        while frame is not None and len(names) < depth:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        if name in names:
            return
        time.sleep(0.001)


def _training_step_that_hangs(path):
    main = threading.main_thread().ident

    def answer_diagnostics():  # like the telemetry thread answering DumpDiagnostics (runtime/session.py)
        _parked(main, "_training_step_that_hangs")  # not while the main thread is still inside start()
        with open(path, "w") as f:
            f.write(f"# trainwarden main_thread=0x{main:016x}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        done.set()

    done = threading.Event()
    t = threading.Thread(target=answer_diagnostics)
    t.start()
    done.wait()
    t.join()


def test_main_thread_frames_from_real_faulthandler_output(tmp_path):
    path = tmp_path / "rank0.stacks"
    _training_step_that_hangs(path)
    frames = main_thread_frames(path.read_text())
    assert frames and "_training_step_that_hangs" in " ".join(frames[:3])
    assert not any("answer_diagnostics" in f for f in frames)
    assert main_thread_frames("garbage\n") == ()


def test_main_thread_is_found_by_the_header_whatever_the_order(tmp_path):
    """Other threads (data loaders, the checkpoint committer) may be listed after the training thread."""
    text = ("# trainwarden main_thread=0x00007f0000000001\n"
            "Current thread 0x00007f0000000003 (most recent call first):\n"
            '  File "/x/session.py", line 190 in dump_diagnostics\n\n'
            "Thread 0x00007f0000000001 (most recent call first):\n"
            '  File "/x/train.py", line 42 in train_step\n\n'
            "Thread 0x00007f0000000002 (most recent call first):\n"
            '  File "/x/loader.py", line 7 in prefetch\n')
    assert main_thread_frames(text)[0] == "train_step (/x/train.py:42)"


def test_read_diagnostics_parses_dumps_and_refuses_code(tmp_path):
    trace = {"entries": [_entry(0, ("0", "default_pg"), 5, retired=False)]}
    (tmp_path / "rank0.fr").write_bytes(pickle.dumps(trace))
    _training_step_that_hangs(tmp_path / "rank0.stacks")
    _training_step_that_hangs(tmp_path / "rank1.stacks")   # stacks only: Flight Recorder off
    (tmp_path / "rank3.fr").write_bytes(pickle.dumps({"entries": [os.getpid]}))  # a global: refused
    (tmp_path / "rank4.fr").write_bytes(pickle.dumps(trace)[:10])  # half written
    found = read_diagnostics(tmp_path, range(5))
    assert sorted(found) == [0, 1]
    assert found[0].positions["0"].seq == 5 and found[0].positions["0"].in_flight
    assert found[0].stack and found[1].positions == {}
    assert found[0].recorded and not found[1].recorded


def test_process_state_of_a_stopped_and_a_dead_worker(procs, tmp_path):
    import signal

    from trainwarden.agent.watchdog.culprit import process_state

    proc = procs.spawn([sys.executable, "-c", "import time; time.sleep(60)"], log=tmp_path / "sleeper.log")
    assert process_state(proc.pid) == "no_answer"
    os.kill(proc.pid, signal.SIGSTOP)
    for _ in range(100):
        if process_state(proc.pid) == "stopped":
            break
        time.sleep(0.05)
    assert process_state(proc.pid) == "stopped"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert process_state(proc.pid) == "dead"


def test_a_flight_recorder_dump_over_the_size_limit_is_not_read(tmp_path):
    import pickle

    from trainwarden.agent.watchdog.culprit import read_diagnostics

    trace = {"entries": [{"process_group": ("0", "default_pg"), "collective_seq_id": 5, "state": "scheduled",
                          "profiling_name": "gloo:all_reduce"}]}
    (tmp_path / "rank0.fr").write_bytes(pickle.dumps(trace))
    assert read_diagnostics(tmp_path, [0])[0].positions  # under the limit: read
    assert read_diagnostics(tmp_path, [0], max_trace_bytes=16) == {}  # over it (and no stacks): not read


_P2P_WAIT = "_wait_batch_p2p (/venv/lib/python3.11/site-packages/torch/distributed/pipelining/schedules.py:683)"


def test_a_rank_waiting_for_its_pipeline_peer_is_blocked_not_blamed_and_the_stopped_peer_is_named():
    """The soak's SIGSTOP of rank 5 (pp=2 x dp=2 x tp=2 on two nodes, gloo): on n0, ranks 0 and 1 never entered
    mesh_dp's all_reduce #298 that ranks 2 and 3 wait in, because their training threads wait for their
    pipeline peers (4 and 5, on n1) in `_wait_batch_p2p`, which gloo's recorder does not show. n0 named 0 and 1
    as culprits beside n1's stopped rank 5."""
    n0 = {
        0: _ev(0, _pos("mesh_dp0", 297), stack=(_P2P_WAIT, "step (schedules.py:700)")),
        1: _ev(1, _pos("mesh_dp1", 297), stack=(_P2P_WAIT, "step (schedules.py:700)")),
        2: _ev(2, _pos("mesh_dp0", 298, in_flight=True)),
        3: _ev(3, _pos("mesh_dp1", 298, in_flight=True)),
    }
    verdict = name_culprit(n0)
    assert verdict.culprits == ()
    assert {g.rank for g in verdict.lags if g.blocked} == {0, 1}
    assert "lag but each waits" in verdict.summary
    n1 = {4: _ev(4, _pos("tp2", 11, in_flight=True)), 5: _ev(5, status="stopped"),
          6: _ev(6, _pos("mesh_dp0", 298, in_flight=True)), 7: _ev(7, _pos("mesh_dp1", 298, in_flight=True))}
    culprits, line = merge_verdicts({"n0": {"verdict": verdict.to_dict()}, "n1": {"verdict": name_culprit(n1).to_dict()}})
    assert culprits == {5: "n1"}, line
    assert line.startswith("culprit rank 5 on n1 (n1: rank 5 is stopped")


def test_the_peer_a_pipeline_rank_waits_for_is_named_when_it_stopped_in_compute():
    """Rank 1 waits in a blocking recv for rank 3, which hangs outside any collective; rank 2 waits in the dp
    all_reduce that neither entered. Only rank 3 is named."""
    recv = "recv (/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py:2790)"
    evidence = {
        1: _ev(1, _pos("dp1", 5), stack=(recv,)),
        2: _ev(2, _pos("dp1", 6, in_flight=True)),
        3: _ev(3, _pos("dp1", 5), stack=("hang (runtime/faults.py:120)", "train (train.py:40)")),
    }
    assert name_culprit(evidence).culprits == (3,)


def test_a_top_frame_elsewhere_is_not_a_point_to_point_wait():
    assert waits_in_p2p((_P2P_WAIT,))
    assert not waits_in_p2p(("forward (model.py:10)", _P2P_WAIT))
    assert not waits_in_p2p(("recv (/home/me/my_socket_lib.py:12)",))
    assert not waits_in_p2p(())

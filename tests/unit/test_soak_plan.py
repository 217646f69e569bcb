"""The soak's fault drawing and invariant logic (tests/bench/_soak_plan.py), without processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from _soak_plan import CATALOGUE, PlannedFault, checkpoints_kept, draw, faults_env, flat, in_round_seconds, \
    ledger_agrees, loss_matches, match_incidents, no_fresh_start  # noqa: E402


def test_the_draw_is_the_seeds_and_spaces_faults_by_the_gap_in_steps():
    a = draw(7, steps=2000, step_s=0.5, kinds=list(CATALOGUE))
    assert [f.describe() for f in a] == [f.describe() for f in draw(7, steps=2000, step_s=0.5, kinds=list(CATALOGUE))]
    assert [f.describe() for f in a] != [f.describe() for f in draw(8, steps=2000, step_s=0.5, kinds=list(CATALOGUE))]
    gaps = [b.step - x.step for x, b in zip(a, a[1:])]
    assert gaps and all(90 <= g <= 180 for g in gaps)  # 45-90 s at 0.5 s a step
    assert a[0].step == 40 and a[-1].step <= 2000 - 60
    for f in a:
        if CATALOGUE[f.kind].inside:
            assert 0 <= f.rank < 4  # a rank every world holds, even with n1 gone
        elif f.kind in ("node_kill", "partition", "agent_kill"):
            assert f.node == "n1"


def test_an_unknown_kind_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown fault kinds .'bitrot'.*crash"):
        draw(1, steps=500, step_s=0.5, kinds=["crash", "bitrot"])


def test_only_the_workers_own_faults_reach_the_environment():
    faults = [PlannedFault(index=0, kind="crash", step=40, rank=5), PlannedFault(index=1, kind="hang", step=90, rank=2),
              PlannedFault(index=2, kind="slow", step=150, rank=1), PlannedFault(index=3, kind="nan", step=200, rank=3)]
    assert faults_env(faults) == "hang:rank=2,step=90;slow:rank=1,from=150,until=180,factor=3;nan:rank=3,step=200"
    assert faults_env(faults, only=("nan",)) == "nan:rank=3,step=200"


def _run(losses, *, start=0.0):
    """(time, step, loss) of steps 1..N, one a second."""
    return [(start + i, i, loss) for i, loss in enumerate(losses, start=1)]


def test_the_final_loss_is_bit_equal_unless_the_world_changed():
    reference = _run([3.0 - 0.001 * i for i in range(300)])
    assert loss_matches(reference, reference, shrank_at=None).ok
    off = reference[:-1] + [(300.0, 300, reference[-1][2] + 1e-6)]
    assert not loss_matches(off, reference, shrank_at=None).ok
    assert not loss_matches([], reference, shrank_at=None).ok


def test_after_a_shrink_the_steps_before_it_are_bit_equal_and_the_last_100_agree_on_average():
    """The hour's soak (session 30): after the world changed size, the trajectory drifted from 1e-6 to several per
    cent a step; the final step's loss was 7.6 % off, the last 100 steps' mean 0.9 %."""
    reference = _run([3.0 - 0.001 * i for i in range(300)])
    drifted = [(t, s, loss * (1.08 if s % 2 else 0.93)) if s > 150 else (t, s, loss) for t, s, loss in reference]
    verdict = loss_matches(drifted, reference, shrank_at=120.5)  # the world shrank after step 120
    assert verdict.ok, verdict.detail
    assert "120 steps before the world first changed size bit-equal: True" in verdict.detail
    inexact = [(t, s, loss + 1e-6) if s == 60 else (t, s, loss) for t, s, loss in drifted]  # a resume before it
    assert not loss_matches(inexact, reference, shrank_at=120.5).ok
    worse = [(t, s, loss * 1.06) if s > 200 else (t, s, loss) for t, s, loss in reference]
    assert not loss_matches(worse, reference, shrank_at=120.5).ok  # 6 % off on average at the end
    assert not loss_matches(reference[:-1], reference, shrank_at=120.5).ok  # it did not finish


def test_a_step_trained_again_after_a_restore_must_equal_its_first_run():
    """Session 31's hour: 42 steps trained again after restores, every one bit-equal to its first run. A replay in a
    world of the same shape must be bit-equal; across a shrink, within REPLAY_TOLERANCE (another summation order)."""
    reference = _run([3.0 - 0.001 * i for i in range(300)])
    worlds = [(0.0, "2 stages, 2 micro-batches"), (250.5, "2 stages, 4 micro-batches")]
    # steps 241-250 ran, a crash, restored from step 240 and trained again in a world of the same shape
    exact = reference[:250] + [(250.2 + i / 100, s, loss) for i, (_, s, loss) in enumerate(reference[240:250])] \
        + reference[250:]
    verdict = loss_matches(exact, reference, shrank_at=None, worlds=worlds[:1])
    assert verdict.ok, verdict.detail
    assert "10 steps trained again after a restore, 0 unlike their first run" in verdict.detail
    off = [(t, s, loss + 1e-6) if t > 250.2 and s == 245 else (t, s, loss) for t, s, loss in exact]
    verdict = loss_matches(off, reference, shrank_at=None, worlds=worlds[:1])
    assert not verdict.ok and "step 245" in verdict.detail, verdict.detail
    # the same replay after the world shrank at 250.5: another summation order may move the 6th decimal
    shrunk = reference[:250] + [(250.6 + i / 100, s, loss * (1 + 2e-6)) for i, (_, s, loss) in
                                enumerate(reference[240:250])] + [(t + 1, s, loss) for t, s, loss in reference[250:]]
    verdict = loss_matches(shrunk, reference, shrank_at=250.5, worlds=worlds)
    assert verdict.ok, verdict.detail
    astray = [(t, s, loss * 1.01) if 250.6 <= t < 251 else (t, s, loss) for t, s, loss in shrunk]
    assert not loss_matches(astray, reference, shrank_at=250.5, worlds=worlds).ok


def test_a_commit_replaced_or_lost_off_the_record_breaks_the_checkpoint_invariant():
    commits = [(1.0, 10, "/c/step-10"), (2.0, 20, "/c/step-20"), (3.0, 30, "/c/step-30"), (4.0, 40, "/c/step-40")]
    present = {"/c/step-20", "/c/step-30", "/c/step-40"}
    assert checkpoints_kept(commits, present, 3, set()).ok  # step 10: retention's
    assert not checkpoints_kept(commits, present - {"/c/step-30"}, 3, set()).ok
    assert checkpoints_kept(commits, present - {"/c/step-30"}, 3, {30}).ok  # set aside, on the record
    again = commits + [(5.0, 30, "/c/step-30")]
    assert not checkpoints_kept(again, present, 3, set()).ok
    assert checkpoints_kept(again, present, 3, {30}).ok


def test_step_one_after_a_commit_is_a_fresh_start():
    story = [(1.0, "step", 1), (2.0, "step", 10), (2.1, "commit", 10), (3.0, "step", 11)]
    assert no_fresh_start(story).ok
    assert not no_fresh_start(story + [(4.0, "step", 1)]).ok


def _inc(kind, t, node="n0", ranks=(), detail=""):
    return {"kind": kind, "detected_at": t, "node": node, "ranks": list(ranks), "evidence": {"detail": detail}}


def test_a_straggler_flagged_past_the_hourly_incident_limit_counts_as_its_faults_incident():
    """Session 35's hour drew 7 slow ranks; the watchdog records 6 straggler incidents a job an hour and says the
    7th in its log. Judged before from the incidents alone: "no straggler_start incident"."""
    import time

    from _soak_plan import flags_over_the_limit

    at = time.mktime(time.strptime("2026-11-30 15:23:00", "%Y-%m-%d %H:%M:%S"))
    log = ("2026-11-30 15:23:15,131 WARNING trainwarden trainwarden.agent.watchdog.loop: job soak rank 0 flagged as "
           "a straggler again; no incident recorded: 6 straggler incidents opened in the last hour (the limit)\n"
           "2026-11-30 15:23:16,000 WARNING trainwarden trainwarden.agent.watchdog.loop: job soak rank 2 flagged as "
           "a straggler again; no incident recorded: an incident for this rank is still open\n"
           "2026-11-30 15:23:17,000 WARNING x: job other rank 1 flagged as a straggler again; no incident recorded: "
           "6 straggler incidents opened in the last hour (the limit)\n")
    flags = flags_over_the_limit("n0", log, "soak")
    assert [(f["node"], f["ranks"], f["detected_at"] - at) for f in flags] == [("n0", [0], 15.0)]
    slow = PlannedFault(index=0, kind="slow", step=1979, rank=0, at=at)
    assert "no straggler_start" in match_incidents([slow], []).detail
    assert match_incidents([slow], flags).ok


def test_every_fault_is_exactly_its_incidents_and_nothing_else_is_one():
    crash = PlannedFault(index=0, kind="crash", step=40, rank=5, at=100.0)
    lost = PlannedFault(index=1, kind="node_kill", step=90, node="n1", at=200.0)
    etcd = PlannedFault(index=2, kind="etcd_member", step=150, variant="e1", at=300.0)
    faults = [crash, lost, etcd]
    right = [_inc("crash", 101, "n1", [5]), _inc("restart", 101.5), _inc("node_lost", 215, "n1", [4, 5, 6, 7])]
    assert match_incidents(faults, right).ok
    assert "names ranks [4]" in match_incidents(faults, [_inc("crash", 101, "n1", [4]), right[2]]).detail
    assert "no node_lost" in match_incidents(faults, right[:2]).detail
    doubled = right + [_inc("node_lost", 216, "n1", [4])]
    assert not match_incidents(faults, doubled).ok
    false_alarm = right + [_inc("hang", 301, "n0", [2])]
    assert "etcd_member (e1) at step 150: unexpected hang" in match_incidents(faults, false_alarm).detail
    assert "before any fault" in match_incidents(faults, right + [_inc("hang", 50)]).detail


def test_resources_are_flat_against_their_level_after_the_first_restart():
    row = lambda rss, threads, fds: {"rss": rss, "threads": threads, "fds": fds}  # noqa: E731
    samples = [(1.0, "n0 agent 1", row(100, 10, 20)), (5.0, "n0 agent 1", row(200, 20, 40)),
               (9.0, "n0 agent 1", row(210, 21, 41))]
    assert flat(samples, 4.0, settle=0, window=1).ok  # the start-up before the baseline does not count
    assert not flat(samples + [(12.0, "n0 agent 1", row(250, 21, 41))], 4.0, settle=0, window=1).ok
    assert not flat(samples, 100.0, settle=0, window=1).ok  # nothing sampled after the baseline: no evidence
    # a process started after the baseline is levelled once it has settled, not while it starts up
    late = [(10.0, "n1 launcher 2", row(100, 1, 5)), (80.0, "n1 launcher 2", row(300, 12, 20)),
            (200.0, "n1 launcher 2", row(310, 12, 20))]
    assert flat(samples + late, 4.0, settle=60, window=1).ok
    # a launcher's 13 threads and 16 fds may be 3 more (an etcd failover's watcher and sockets), not 4
    launcher = [(5.0, "n0 launcher 3", row(300, 13, 16)), (9.0, "n0 launcher 3", row(300, 16, 19))]
    assert flat(launcher, 4.0, settle=0, window=1).ok
    assert not flat(launcher + [(12.0, "n0 launcher 3", row(300, 17, 19))], 4.0, settle=0, window=1).ok


def test_a_process_level_and_end_are_medians_so_a_passing_thread_is_not_growth_and_a_leak_is():
    row = lambda rss, threads, fds: {"rss": rss, "threads": threads, "fds": fds}  # noqa: E731
    band = [(10.0 + 5 * i, "n0 agent 1", row(60, 39 + (i % 7 == 3) * 6, 23 + (i % 5 == 4) * 5)) for i in range(200)]
    band[-1] = (band[-1][0], "n0 agent 1", row(60, 45, 28))  # the last sample catches a failover in passing
    assert not flat(band, 4.0, settle=0, window=1).ok
    assert flat(band, 4.0, settle=0).ok, flat(band, 4.0, settle=0).detail
    leak = [(10.0 + 5 * i, "n0 agent 1", row(60 + i // 10, 39 + i // 20, 23)) for i in range(200)]
    verdict = flat(leak, 4.0, settle=0)
    assert not verdict.ok and "rss" in verdict.detail and "threads" in verdict.detail


def test_a_failed_flat_resources_names_what_the_process_holds_more_of():
    """The daemon soak's hour (session 36): n1's launcher went from 24 to 31 fds, and the verdict said only that."""
    def row(fds, held):
        return {"rss": 60, "threads": 30, "fds": fds, "held": held}

    base = {"fd socket": 10, "fd pipe": 4, "fd anon_inode:[eventpoll]": 2, "thread grpc_global_tim": 1}
    grown = {**base, "fd socket": 15, "fd anon_inode:[eventpoll]": 4, "thread grpc_global_tim": 2}
    samples = [(float(i), "n1 agent 7", row(16, base)) for i in range(3)] + \
        [(10.0 + i, "n1 agent 7", row(23, grown)) for i in range(3)]
    verdict = flat(samples, 0.0, settle=0, window=3)
    assert not verdict.ok
    assert verdict.detail == "n1 agent 7 fds 16 -> 23 (+5 socket, +2 anon_inode:[eventpoll])"


def test_a_launcher_that_took_up_hosting_the_rendezvous_store_is_levelled_in_that_role():
    """Session 38: after the world changed, n1's launcher hosted the round's TCPStore (16 fds -> 35) and n0's no
    longer did (35 -> 18). The role moved; neither leaked. A launcher that grows within one role still fails."""
    def row(fds, store):
        return {"rss": 60, "threads": 12 + store, "fds": fds, "held": {"thread pt_tcpstore_uv": store}}

    n1 = [(float(i), "n1 launcher 5", row(16, 0)) for i in range(5)] + \
        [(10.0 + i, "n1 launcher 5", row(35, 1)) for i in range(5)]
    n0 = [(float(i), "n0 launcher 4", row(35, 1)) for i in range(5)] + \
        [(10.0 + i, "n0 launcher 4", row(18, 0)) for i in range(5)]
    verdict = flat(n1 + n0, 0.0, settle=0, window=3)
    assert verdict.ok, verdict.detail
    assert "n1 launcher 5 rss 0->0 MiB threads 13->13 fds 35->35 (since its rendezvous store role changed)" in \
        verdict.detail
    leak = n1 + [(20.0 + i, "n1 launcher 5", row(45, 1)) for i in range(5)]
    assert not flat(leak, 0.0, settle=0, window=3).ok


def test_a_kind_a_fault_may_also_cause_is_allowed_once_per_node():
    corrupt = PlannedFault(index=0, kind="ckpt_corrupt", step=40, variant="flip", at=100.0)
    seen = [_inc("checkpoint_set_aside", 110, "n0", [0]), _inc("node_lost", 105, "n1", [4, 5, 6, 7])]
    assert match_incidents([corrupt], seen).ok
    assert not match_incidents([corrupt], seen + [_inc("node_lost", 106, "n1", [4])]).ok
    assert "no checkpoint_set_aside" in match_incidents([corrupt], seen[1:]).detail



def test_a_lost_nodes_unfinished_save_and_a_partitions_culpritless_hang_are_consequences_nothing_else_is():
    cut = PlannedFault(index=0, kind="partition", step=90, node="n1", at=100.0)
    own = [_inc("node_lost", 110, "n1", [4, 5, 6, 7]), _inc("fenced", 112, "n1")]
    unfinished = _inc("checkpoint_set_aside", 140, "n0", [0], detail="unfinished: step-00000090: no .metadata")
    assert match_incidents([cut], own + [unfinished, _inc("hang", 138, "n0")]).ok
    corrupt = _inc("checkpoint_set_aside", 140, "n0", [0], detail="corrupt: 1 file(s) do not match")
    assert "unexpected checkpoint_set_aside" in match_incidents([cut], own + [corrupt]).detail
    assert "unexpected hang" in match_incidents([cut], own + [_inc("hang", 138, "n0", [2])]).detail
    twice = own + [unfinished, {**unfinished, "detected_at": 150}]
    assert not match_incidents([cut], twice).ok  # at most one per node


def test_a_per_node_observation_may_be_recorded_by_each_node_once():
    slow = PlannedFault(index=0, kind="degrade", step=90, node="n1", at=100.0)
    assert match_incidents([slow], [_inc("comm_regression", 130, "n0"), _inc("comm_regression", 131, "n1")]).ok
    assert match_incidents([slow], [_inc("comm_regression", 130, "n0")]).ok
    assert "no comm_regression" in match_incidents([slow], []).detail
    assert "a second comm_regression on n0" in match_incidents(
        [slow], [_inc("comm_regression", 130, "n0"), _inc("comm_regression", 150, "n0")]).detail
    full = PlannedFault(index=0, kind="enospc", step=90, at=100.0)
    assert match_incidents([full], [_inc("checkpoint_failed", 120, "n0", [0]), _inc("checkpoint_failed", 120, "n1", [4])]).ok


def test_the_new_kinds_are_drawn_with_their_targets():
    faults = draw(16, steps=461, step_s=1.3, kinds=["quorum", "enospc", "degrade"])
    assert {f.kind for f in faults} == {"quorum", "enospc", "degrade"}
    for f in faults:
        if f.kind == "quorum":
            assert len(set(f.variant.split(","))) == 2 and set(f.variant.split(",")) <= {"e0", "e1", "e2"}
        if f.kind == "degrade":
            assert f.node == "n1"


def test_the_time_in_rounds_on_kept_steps_is_what_every_rank_agrees_on():
    """Two ranks of one round time their steps differently (a pipeline's stages): rank A's steps last 0.6 s with
    0.4 s between, rank B's 0.9 s with 0.1 s between; their time in the round on the kept steps is the same."""
    a = [(10.0 + i, i + 1, 0.6) for i in range(10)]
    b = [(10.05 + i, i + 1, 0.9) for i in range(10)]
    assert in_round_seconds(a, [9.0]) == pytest.approx(0.6 + 9.0)
    assert in_round_seconds(b, [9.0]) == pytest.approx(0.9 + 9.0)
    # a restart: steps 6-10 redone in a new round from step 5; only their last run counts, the new round's first
    # step its own duration (the gap before it is the restart's)
    redo = a + [(40.0 + i, 6 + i, 0.6) for i in range(5)]
    assert in_round_seconds(redo, [9.0, 38.0]) == pytest.approx((0.6 + 4.0) + (0.6 + 4.0))
    ledger = {"productive_s": 7.0, "badput_s": {"between_steps": 2.4, "checkpoint_stall": 0.2}, "wall_s": 19.1}
    assert ledger_agrees(ledger, a, [9.0], 0.0).ok
    assert not ledger_agrees({**ledger, "productive_s": 6.0}, a, [9.0], 0.0).ok
    assert not ledger_agrees(ledger, [], [], 0.0).ok


def test_a_quorum_loss_may_refuse_one_save_a_node_not_two():
    lost = PlannedFault(index=0, kind="quorum", step=190, variant="e1,e2", at=100.0)
    refused = _inc("checkpoint_failed", 120, "n0", [0], detail="fenced: etcd could not check the job's round")
    assert match_incidents([lost], []).ok
    assert match_incidents([lost], [refused]).ok
    assert not match_incidents([lost], [refused, {**refused, "detected_at": 126}]).ok
    assert not match_incidents([lost], [_inc("checkpoint_failed", 120, "n0", [0], detail="No space left")]).ok


def test_a_slow_windows_end_belongs_to_its_start_even_after_the_next_fault():
    """Seed 30: the slow rank's straggler_end came after the next fault (an agent kill) was injected, and was
    taken for that fault's false alarm."""
    slow = PlannedFault(index=0, kind="slow", step=154, rank=2, at=100.0)
    kill = PlannedFault(index=1, kind="agent_kill", step=191, node="n1", at=200.0)
    seen = [_inc("straggler_start", 120, "n0", [2]), _inc("node_lost", 215, "n1", [4, 5, 6, 7]),
            _inc("straggler_end", 212, "n0", [2])]
    assert match_incidents([slow, kill], seen).ok
    assert "unexpected straggler_end" in match_incidents([slow, kill], seen[1:]).detail  # no start: not a window's end


def test_the_world_first_changed_size_at_the_first_shrinking_fault_or_round_of_another_shape():
    """Session 33: a SIGSTOP (a kind that does not shrink the world) left n0 alone in the next round; the steps
    after it were judged bit for bit against the full world's and failed."""
    from _soak_plan import first_shrink

    full, half = "2 stages, 2 micro-batches", "2 stages, 4 micro-batches"
    assert first_shrink([], [(10.0, full), (50.0, full)]) is None
    assert first_shrink([], [(10.0, full), (50.0, half), (80.0, full)]) == 50.0
    assert first_shrink([70.0, 90.0], [(10.0, full), (50.0, half)]) == 50.0
    assert first_shrink([30.0], [(10.0, full), (50.0, half)]) == 30.0
    assert first_shrink([30.0], []) == 30.0

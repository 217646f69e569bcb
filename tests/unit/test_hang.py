import pytest

from trainwarden.agent.watchdog.hang import HangConfig, HangDetector

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _run(det, clock, counts, *, p99=0.3, round_id=("r", 1), in_checkpoint=False, running=True, job="j"):
    return det.observe(job, round_id=round_id, step_counts=counts, step_p99_s=p99, in_checkpoint=in_checkpoint,
                       running=running)


def _warm(det, clock, steps=10, dt=0.3, round_id=("r", 1)):
    counts = {0: 0, 1: 0}
    for _ in range(steps):
        clock.now += dt
        counts = {r: c + 1 for r, c in counts.items()}
        check = _run(det, clock, counts, round_id=round_id)
        assert not check.hung
    return counts


def test_config_validation_names_the_problem():
    with pytest.raises(ValueError, match="floor_s"):
        HangConfig(floor_s=10, ceiling_s=5)
    with pytest.raises(ValueError, match="multiplier"):
        HangConfig(multiplier=0.5)
    with pytest.raises(ValueError, match="startup_s"):
        HangConfig(floor_s=10, startup_s=5)
    with pytest.raises(ValueError, match="warmup_s"):
        HangConfig(warmup_s=-1)
    with pytest.raises(ValueError, match="warmup_steps"):
        HangConfig(warmup_steps=-1)


def test_steady_timeout_is_multiple_of_p99_clamped():
    cfg = HangConfig(multiplier=5, floor_s=5, ceiling_s=300)
    assert cfg.steady_timeout(0.3) == 5          # floor
    assert cfg.steady_timeout(2.0) == 10         # 5 x p99
    assert cfg.steady_timeout(100.0) == 300      # ceiling
    assert cfg.steady_timeout(0.0) == 5          # unknown: floor


def test_fires_once_after_the_floor_on_a_fast_job():
    clock = Clock()
    det = HangDetector(HangConfig(), clock=clock)
    counts = _warm(det, clock)
    clock.now += 1.4
    assert not _run(det, clock, counts).hung
    clock.now += 0.2
    check = _run(det, clock, counts)
    assert check.hung and check.reason == "steady" and check.timeout_s == 1.5  # the default floor
    assert check.stalled_s == pytest.approx(1.6)
    clock.now += 10
    assert not _run(det, clock, counts).hung  # disarmed until progress or a new round


def test_progress_counts_from_when_the_step_ended_not_from_when_its_batch_arrived():
    """Steps reach the agent in batches (every 1.5 s): a hang's last step must start the deadline when it
    ended, or every hang would be declared up to a batch late."""
    clock = Clock()
    det = HangDetector(HangConfig(floor_s=5.0), clock=clock)
    counts = _warm(det, clock)
    clock.now += 1.5
    counts = {r: c + 5 for r, c in counts.items()}  # a batch: its newest step ended 1.2 s ago, then the hang
    check = det.observe("j", round_id=("r", 1), step_counts=counts, step_p99_s=0.3, in_checkpoint=False,
                        running=True, progress_age_s=1.2)
    assert check.progressed and check.stalled_s == pytest.approx(1.2)
    clock.now += 3.7
    assert not _run(det, clock, counts).hung
    clock.now += 0.1
    check = _run(det, clock, counts)
    assert check.hung and check.stalled_s == pytest.approx(5.0)
    # the next batch: counted from its newest step's end again
    clock.now += 1.0
    counts = {r: c + 1 for r, c in counts.items()}
    check = det.observe("j", round_id=("r", 1), step_counts=counts, step_p99_s=0.3, in_checkpoint=False,
                        running=True, progress_age_s=0.5)
    assert check.stalled_s == pytest.approx(0.5)


def test_one_rank_progressing_is_progress():
    clock = Clock()
    det = HangDetector(HangConfig(), clock=clock)
    counts = _warm(det, clock)
    for _ in range(10):
        clock.now += 1.0
        counts = {0: counts[0] + 1, 1: counts[1]}
        assert not _run(det, clock, counts).hung


def test_rearms_after_progress_and_after_a_new_round():
    clock = Clock()
    det = HangDetector(HangConfig(), clock=clock)
    counts = _warm(det, clock)
    clock.now += 6
    assert _run(det, clock, counts).hung
    # progress re-arms
    counts = {r: c + 1 for r, c in counts.items()}
    clock.now += 0.3
    assert _run(det, clock, counts).progressed
    clock.now += 6
    assert _run(det, clock, counts).hung
    # a new round (new pids) re-arms with the start-up allowance
    clock.now += 1
    check = _run(det, clock, counts, round_id=("r", 2))
    assert not check.hung and check.reason == "startup" and check.steps_since_start == 0


def test_startup_allowance_until_warmup_steps():
    clock = Clock()
    cfg = HangConfig(startup_s=60, warmup_steps=3)
    det = HangDetector(cfg, clock=clock)
    counts = {0: 0, 1: 0}
    _run(det, clock, counts)  # the round starts
    clock.now += 59
    check = _run(det, clock, counts)
    assert not check.hung and check.reason == "startup" and check.timeout_s == 60
    clock.now += 2
    assert _run(det, clock, counts).hung
    # after a restart: counts are cumulative, steps since start are counted from the round's baseline
    clock.now += 1
    _run(det, clock, {0: 50, 1: 50}, round_id=("r", 2))
    for i in range(1, 4):
        clock.now += 20  # slow first steps, within the allowance
        check = _run(det, clock, {0: 50 + i, 1: 50 + i}, round_id=("r", 2))
        assert not check.hung
    assert check.steps_since_start == 3 and check.reason == "steady"


def test_a_stall_after_a_restarts_first_step_is_a_hang_after_warmup_s_not_startup_s():
    """The soak's hour (session 33): a rank SIGSTOPped 2 steps after a restart was held to the 300 s start-up
    deadline (the soak gave up on the job after 240 s), and a hang 1 step after a grow-back was aborted after 300 s.
    The start-up's unmeasured work (rendezvous, process groups, restore, compilation) ends with the round's first
    step; the first steps after it get ``warmup_s``."""
    clock = Clock()
    det = HangDetector(HangConfig(), clock=clock)
    counts = _warm(det, clock)
    clock.now += 1
    _run(det, clock, counts, round_id=("r", 2))  # the restart: its first step takes the start-up's time
    clock.now += 200
    check = _run(det, clock, counts, round_id=("r", 2))
    assert not check.hung and check.reason == "startup" and check.timeout_s == 300
    clock.now += 1
    counts = {r: c + 1 for r, c in counts.items()}
    assert _run(det, clock, counts, round_id=("r", 2)).progressed  # its first step
    clock.now += 29
    check = _run(det, clock, counts, round_id=("r", 2))
    assert not check.hung and check.reason == "warmup" and check.timeout_s == 30
    clock.now += 2
    check = _run(det, clock, counts, round_id=("r", 2))
    assert check.hung and check.reason == "warmup" and check.steps_since_start == 1


def test_checkpoint_extends_the_deadline():
    clock = Clock()
    det = HangDetector(HangConfig(checkpoint_s=120), clock=clock)
    counts = _warm(det, clock)
    clock.now += 100
    check = _run(det, clock, counts, in_checkpoint=True)
    assert not check.hung and check.reason == "checkpoint"
    clock.now += 21
    assert _run(det, clock, counts, in_checkpoint=True).hung


def test_not_running_pauses_the_clock():
    clock = Clock()
    det = HangDetector(HangConfig(floor_s=5.0), clock=clock)
    counts = _warm(det, clock)
    clock.now += 100
    assert not _run(det, clock, counts, running=False).hung
    clock.now += 4
    assert not _run(det, clock, counts).hung  # stalled 4 s since it was last seen not running
    clock.now += 2
    assert _run(det, clock, counts).hung


def test_jobs_are_independent_and_forgotten():
    clock = Clock()
    det = HangDetector(HangConfig(), clock=clock)
    _run(det, clock, {0: 5}, job="a")
    _run(det, clock, {0: 5}, job="b")
    assert det.jobs() == ["a", "b"]
    det.forget("a")
    assert det.jobs() == ["b"]


def test_the_end_of_a_long_save_is_not_a_hang():
    """A save longer than the steady deadline ends; the next step's report is still in flight."""
    clock = Clock()
    det = HangDetector(HangConfig(checkpoint_s=120), clock=clock)
    counts = _warm(det, clock)
    for _ in range(24):  # 12 s inside the save, watched every 0.5 s
        clock.now += 0.5
        assert not _run(det, clock, counts, in_checkpoint=True).hung
    clock.now += 0.5
    check = _run(det, clock, counts, in_checkpoint=False)
    assert not check.hung and check.reason == "steady"
    clock.now += 10  # and then nothing: a real hang after the save is still caught
    assert _run(det, clock, counts).hung


def test_a_restore_that_keeps_reading_is_never_a_hang_however_long():
    """Issue 9, defect 15: the allowance was a constant 600 s, so a restore longer than it was aborted,
    restarted, restored again and aborted again. Now it runs from the last I/O progress."""
    clock = Clock()
    det = HangDetector(HangConfig(checkpoint_s=120, checkpoint_io_bytes=1 << 20), clock=clock)
    counts = _warm(det, clock)
    read = {0: 5_000, 1: 7_000}
    for _ in range(40):  # 40 minutes inside restore_start, each rank reading 64 MiB a minute
        clock.now += 60
        read = {r: b + (64 << 20) for r, b in read.items()}
        check = det.observe("j", round_id=("r", 1), step_counts=counts, step_p99_s=0.3, in_checkpoint=True,
                            running=True, checkpoint_io=read)
        assert not check.hung and check.reason == "checkpoint"
    # the filesystem stops answering: a few KiB of telemetry and log lines are not progress
    for _ in range(3):
        clock.now += 40
        read = {r: b + 4096 for r, b in read.items()}
        check = det.observe("j", round_id=("r", 1), step_counts=counts, step_p99_s=0.3, in_checkpoint=True,
                            running=True, checkpoint_io=read)
    assert check.hung and check.stalled_s == 120


def test_checkpoint_io_needs_a_baseline_per_rank():
    """A rank's first reading (it entered the stage; a new process) is its baseline, not progress."""
    clock = Clock()
    det = HangDetector(HangConfig(checkpoint_s=120), clock=clock)
    counts = _warm(det, clock)

    def observe(io):
        return det.observe("j", round_id=("r", 1), step_counts=counts, step_p99_s=0.3, in_checkpoint=True,
                           running=True, checkpoint_io=io)

    clock.now += 100
    assert not observe({0: 10 << 30}).hung  # 10 GiB read before the stage began
    clock.now += 30
    assert observe({0: 10 << 30, 1: 20 << 30}).hung  # rank 1 joins the stage: a baseline, not progress


def test_without_io_counters_the_allowance_is_the_plain_deadline():
    clock = Clock()
    det = HangDetector(HangConfig(checkpoint_s=120), clock=clock)
    counts = _warm(det, clock)
    clock.now += 119
    assert not det.observe("j", round_id=("r", 1), step_counts=counts, step_p99_s=0.3, in_checkpoint=True,
                           running=True, checkpoint_io={}).hung
    clock.now += 1
    assert det.observe("j", round_id=("r", 1), step_counts=counts, step_p99_s=0.3, in_checkpoint=True,
                       running=True, checkpoint_io={}).hung
    with pytest.raises(ValueError, match="checkpoint_io_bytes"):
        HangConfig(checkpoint_io_bytes=0)


# ---- collectives as the heartbeat ----------------------------------------------------------------------


def _observe_collectives(det, counts, *, steps=None, gap=0.1, age=0.0, report=0.0):
    return det.observe("j", round_id=("r", 1), step_counts=steps or {0: 0, 1: 0}, step_p99_s=0.0,
                       in_checkpoint=False, running=True, collective_counts=counts, collective_gap_s=gap,
                       collective_age_s=age, collective_report_s=report)


def test_a_loop_without_steps_gets_its_deadline_from_its_collectives_after_their_warm_up():
    clock = Clock()
    det = HangDetector(HangConfig(warmup_collectives=64, floor_s=5.0), clock=clock)
    counts = {0: 0, 1: 0}
    check = _observe_collectives(det, counts)
    assert check.reason == "startup" and check.timeout_s == 300  # no collective yet: the start-up deadline
    for _ in range(7):  # 70 collectives per rank, 10 a second
        clock.now += 1.0
        counts = {r: c + 10 for r, c in counts.items()}
        check = _observe_collectives(det, counts, gap=0.4)
        assert check.progressed and not check.hung
    assert check.heartbeat == "collectives" and check.reason == "collectives" and check.timeout_s == 5.0
    clock.now += 4.0
    assert not _observe_collectives(det, counts, gap=0.4).hung
    clock.now += 1.5
    check = _observe_collectives(det, counts, gap=0.4)
    assert check.hung and check.heartbeat == "collectives" and check.stalled_s == pytest.approx(5.5)


def test_the_collective_deadline_follows_the_longest_gap_between_collectives():
    clock = Clock()
    det = HangDetector(HangConfig(warmup_collectives=8), clock=clock)
    counts = {0: 0}
    for _ in range(10):  # an evaluation loop: one all_reduce every 4 s
        clock.now += 4.0
        counts = {0: counts[0] + 1}
        check = _observe_collectives(det, counts, steps={0: 0}, gap=4.0)
    assert check.timeout_s == 20.0  # 5 x 4 s
    clock.now += 12.0
    assert not _observe_collectives(det, counts, steps={0: 0}, gap=4.0).hung


def test_collectives_keep_a_job_with_steps_alive_between_steps_and_keep_the_step_deadline():
    clock = Clock()
    det = HangDetector(HangConfig(), clock=clock)
    counts = _warm(det, clock)
    coll = {0: 100, 1: 100}
    for _ in range(20):  # an evaluation pass of 20 s: collectives, no step
        clock.now += 1.0
        coll = {r: c + 3 for r, c in coll.items()}
        check = det.observe("j", round_id=("r", 1), step_counts=counts, step_p99_s=0.3, in_checkpoint=False,
                            running=True, collective_counts=coll, collective_gap_s=0.2)
        assert not check.hung and check.heartbeat == "steps" and check.reason == "steady"
    clock.now += 5.1  # then nothing moves: the step deadline (5 s floor)
    check = det.observe("j", round_id=("r", 1), step_counts=counts, step_p99_s=0.3, in_checkpoint=False,
                        running=True, collective_counts=coll, collective_gap_s=0.2)
    assert check.hung


def test_collectives_heard_once_a_read_do_not_make_a_healthy_job_look_hung():
    """An evaluation loop all-reduces every 0.03 s, but each rank reports its collectives only when it reads its
    Flight Recorder (every 1.5 s, or 3 s at the slow pace) and sends them at its next flush (0.5 s). Without the
    reporting period in its deadline (max(1.5 s floor, 5 x 0.03 s)) such a job was aborted as hung every few
    seconds; a real stall is still caught, the period later."""
    for report, period in ((2.0, 2.0), (3.5, 3.5)):
        clock = Clock()
        det = HangDetector(HangConfig(warmup_collectives=64), clock=clock)
        counts = {0: 0, 1: 0}
        _observe_collectives(det, counts, gap=0.03, report=report)
        fired = []
        for _ in range(12):  # every `period` s a read's batch arrives; the agent checks every 0.25 s
            for _ in range(int(period / 0.25) - 1):
                clock.now += 0.25
                fired += [_observe_collectives(det, counts, gap=0.03, report=report).hung]
            clock.now += 0.25
            counts = {r: c + int(period / 0.03) for r, c in counts.items()}
            check = _observe_collectives(det, counts, gap=0.03, age=0.1, report=report)
            fired.append(check.hung)
        assert check.heartbeat == "collectives" and check.timeout_s == pytest.approx(1.5 + report)
        assert not any(fired), (report, fired)
        assert _observe_collectives(det, counts, gap=0.03).timeout_s == 1.5  # without: the floor alone
        clock.now += 1.5 + report  # the collectives stop
        check = _observe_collectives(det, counts, gap=0.03, report=report)
        assert check.hung and check.stalled_s == pytest.approx(1.5 + report + 0.1)


def test_a_collective_reported_late_counts_from_when_it_was_entered():
    clock = Clock()
    det = HangDetector(HangConfig(warmup_collectives=1), clock=clock)
    _observe_collectives(det, {0: 0})
    clock.now += 3.0
    check = _observe_collectives(det, {0: 50}, age=2.5)  # read late: the newest was entered 2.5 s ago
    assert check.progressed and check.stalled_s == pytest.approx(2.5)


def test_a_rank_busy_computing_between_steps_is_not_hung_and_one_spinning_forever_is_after_busy_s():
    clock = Clock()
    det = HangDetector(HangConfig(busy_s=60.0), clock=clock)
    counts = _warm(det, clock)
    cpu = {0: 10.0, 1: 10.0}
    for _ in range(30):  # rank 0 evaluates alone for 30 s (a core's worth of CPU), rank 1 waits in a barrier
        clock.now += 1.0
        cpu[0] += 1.0
        cpu[1] += 0.01
        check = det.observe("j", round_id=("r", 1), step_counts=counts, step_p99_s=0.3, in_checkpoint=False,
                            running=True, cpu_seconds=cpu)
        assert not check.hung
    assert check.reason == "busy" and check.timeout_s == 60.0
    for _ in range(40):  # it never comes back: a rank spinning forever is a hang after busy_s
        clock.now += 1.0
        cpu[0] += 1.0
        check = det.observe("j", round_id=("r", 1), step_counts=counts, step_p99_s=0.3, in_checkpoint=False,
                            running=True, cpu_seconds=cpu)
        if check.hung:
            break
    assert check.hung and check.stalled_s == pytest.approx(60.0, abs=1.0)


def test_ranks_that_use_no_cpu_are_hung_at_the_usual_deadline():
    clock = Clock()
    det = HangDetector(HangConfig(floor_s=5.0), clock=clock)
    counts = _warm(det, clock)
    cpu = {0: 10.0, 1: 10.0}
    fired = []
    for _ in range(6):  # a stopped rank and one blocked in a collective: a few ms of CPU for telemetry
        clock.now += 1.0
        cpu = {r: c + 0.01 for r, c in cpu.items()}
        check = det.observe("j", round_id=("r", 1), step_counts=counts, step_p99_s=0.3, in_checkpoint=False,
                            running=True, cpu_seconds=cpu)
        fired += [check] if check.hung else []
    assert [(c.reason, c.timeout_s) for c in fired] == [("steady", 5.0)]


def test_a_rank_whose_process_moves_bytes_is_not_hung_and_a_missing_reading_starts_a_new_baseline():
    """A rank streaming a shard from remote storage uses little CPU but reads megabytes a second: working, not
    hung. A reading left out (the watchdog reads activity only once a job stalls) drops the baselines, so
    bytes moved while the job trained are not taken for activity during the stall."""
    clock = Clock()
    det = HangDetector(HangConfig(busy_s=60.0), clock=clock)
    counts = _warm(det, clock)
    io = {0: 0, 1: 0}
    for _ in range(10):  # rank 0 reads 8 MB a second for 10 s, rank 1 waits for it
        clock.now += 1.0
        io[0] += 8 << 20
        io[1] += 1000
        check = det.observe("j", round_id=("r", 1), step_counts=counts, step_p99_s=0.3, in_checkpoint=False,
                            running=True, io_bytes=io)
        assert not check.hung
    assert check.reason == "busy"
    counts = {r: c + 1 for r, c in counts.items()}
    clock.now += 0.3
    assert _run(det, clock, counts).progressed  # no reading: the baselines go
    io[0] += 100 << 20  # bytes moved while training: no reading saw them start
    fired = []
    for _ in range(4):
        clock.now += 1.0
        io = {0: io[0] + 1000, 1: io[1] + 1000}
        check = det.observe("j", round_id=("r", 1), step_counts=counts, step_p99_s=0.3, in_checkpoint=False,
                            running=True, io_bytes=io)
        fired += [check] if check.hung else []
    assert [(c.reason, c.timeout_s) for c in fired] == [("steady", 1.5)]


def test_stalled_s_is_the_time_since_the_last_progress():
    clock = Clock()
    det = HangDetector(HangConfig(), clock=clock)
    assert det.stalled_s("j") == 0.0
    counts = _warm(det, clock)
    clock.now += 1.25
    assert det.stalled_s("j") == pytest.approx(1.25)
    _run(det, clock, {r: c + 1 for r, c in counts.items()})
    assert det.stalled_s("j") == pytest.approx(0.0)


def test_ranks_that_each_get_a_slice_of_an_oversubscribed_host_are_working_together():
    """Eight ranks on two cores get a quarter of a core each while another tenant takes the rest: no rank uses
    `busy_cores` alone, together they do. Eight idle ranks (their telemetry threads) do not."""
    clock = Clock()
    det = HangDetector(HangConfig(busy_s=60.0), clock=clock)
    counts = {r: 0 for r in range(8)}
    for _ in range(10):
        clock.now += 0.3
        counts = {r: c + 1 for r, c in counts.items()}
        det.observe("j", round_id=("r", 1), step_counts=counts, step_p99_s=0.3, in_checkpoint=False, running=True)
    cpu = {r: 5.0 for r in range(8)}
    for _ in range(10):  # one slow step: 10 s at 0.1 core per rank
        clock.now += 1.0
        cpu = {r: c + 0.1 for r, c in cpu.items()}
        check = det.observe("j", round_id=("r", 1), step_counts=counts, step_p99_s=0.3, in_checkpoint=False,
                            running=True, cpu_seconds=cpu)
        assert not check.hung
    fired = []
    for _ in range(4):  # then a hang: 0.01 core per rank
        clock.now += 1.0
        cpu = {r: c + 0.01 for r, c in cpu.items()}
        check = det.observe("j", round_id=("r", 1), step_counts=counts, step_p99_s=0.3, in_checkpoint=False,
                            running=True, cpu_seconds=cpu)
        fired += [check] if check.hung else []
    assert [c.reason for c in fired] == ["steady"]


def test_ranks_that_spin_while_they_wait_for_a_collective_are_hung_at_the_usual_deadline():
    """Ranks of a GPU job blocked in a hung NCCL collective spin a core each inside a CUDA synchronize. Their own
    CPU, reported as waiting, is not work: the hang is caught on the usual deadline. Counted as work (before
    issue 26's fix), the same spin held the job to busy_s."""
    for waiting, expected in ((True, [("steady", 1.5)]), (False, [])):
        clock = Clock()
        det = HangDetector(HangConfig(busy_s=60.0), clock=clock)
        counts = _warm(det, clock)
        own = {0: 10.0, 1: 10.0}
        fired = []
        for _ in range(40):  # 10 s, a reading every 0.25 s, each rank a whole core
            clock.now += 0.25
            own = {r: c + 0.25 for r, c in own.items()}
            check = det.observe("j", round_id=("r", 1), step_counts=counts, step_p99_s=0.3, in_checkpoint=False,
                                running=True, cpu_seconds=dict(own), waiting_cpu_seconds=dict(own) if waiting else {})
            fired += [(check.reason, check.timeout_s)] if check.hung else []
        assert fired == expected, waiting
        if not waiting:
            assert check.reason == "busy" and check.timeout_s == 60.0


def test_a_waiting_rank_whose_children_compute_and_a_peer_that_computes_are_still_work():
    """Only the waiting rank's own CPU is left out: its DataLoader workers' CPU counts, and so does a peer that
    computes alone (it has no collective in flight, so it is not reported waiting)."""
    for name, children, peer in (("children", 0.25, 0.0), ("peer", 0.0, 0.25)):
        clock = Clock()
        det = HangDetector(HangConfig(busy_s=60.0), clock=clock)
        counts = _warm(det, clock)
        own, tree = 10.0, {0: 10.0, 1: 10.0}
        for _ in range(40):
            clock.now += 0.25
            own += 0.25
            tree = {0: tree[0] + 0.25 + children, 1: tree[1] + peer}
            check = det.observe("j", round_id=("r", 1), step_counts=counts, step_p99_s=0.3, in_checkpoint=False,
                                running=True, cpu_seconds=dict(tree), waiting_cpu_seconds={0: own})
            assert not check.hung, name
        assert check.reason == "busy", name

import random

import pytest

from trainwarden.agent.straggler import RankSample, StragglerConfig, StragglerDetector, StragglerPolicy

pytestmark = pytest.mark.timeout(30)


class Job:
    """Synchronous training simulated per flight-recorder interval: every rank's step lasts as long as the
    slowest rank's compute; the others wait for it in the collective. Counters are cumulative."""

    def __init__(self, ranks=4, compute=0.2, noise=0.0, seed=0):
        self.compute = {r: compute for r in range(ranks)}
        self.slow = {r: 1.0 for r in range(ranks)}
        self.noise = noise
        self.rng = random.Random(seed)
        self.c = {r: [0, 0.0, 0.0] for r in range(ranks)}

    def run(self, steps):
        for _ in range(steps):
            work = {r: self.compute[r] * self.slow[r] * (1 + self.rng.uniform(-self.noise, self.noise))
                    for r in self.c}
            step = max(work.values()) + 0.01
            for r, c in self.c.items():
                c[0] += 1
                c[1] += step
                c[2] += step - work[r]
        return {r: RankSample(c[0], c[1], c[2]) for r, c in self.c.items()}


def _drive(det, job, intervals, steps_per_interval=7, groups=None):
    events = []
    for _ in range(intervals):
        events += det.update("j", job.run(steps_per_interval), groups)
    return events


def test_config_validation():
    with pytest.raises(ValueError, match="clear_score"):
        StragglerConfig(start_score=1.05, clear_score=1.1)
    with pytest.raises(ValueError, match="window_steps"):
        StragglerConfig(window_steps=1)
    with pytest.raises(ValueError, match="persist"):
        StragglerConfig(persist=0)
    assert StragglerConfig(policy="exclude").policy is StragglerPolicy.EXCLUDE


def test_a_rank_slowed_1_2x_is_flagged_after_persisting_and_cleared_with_hysteresis():
    det = StragglerDetector(StragglerConfig(window_steps=20, persist=3, clear_persist=4))
    job = Job(noise=0.03)
    assert _drive(det, job, 10) == []
    job.slow[2] = 1.2
    events = _drive(det, job, 3)   # the window still holds mostly normal steps or persistence not reached
    assert not any(e.started for e in events)
    events = _drive(det, job, 6)
    assert [(e.rank, e.started) for e in events] == [(2, True)]
    start = events[0]
    assert start.score.score == pytest.approx(1.2, rel=0.05) and start.evaluations == 3
    assert start.score.wait_per_step_s < start.score.peer_wait_per_step_s
    assert det.flagged("j") == [2]
    scores = det.scores()["j"]
    assert scores[2].flagged and all(0.9 < scores[r].score < 1.05 for r in (0, 1, 3))
    # back to normal: cleared only after clear_persist evaluations below clear_score
    job.slow[2] = 1.0
    events = _drive(det, job, 12)
    assert [(e.rank, e.started) for e in events] == [(2, False)]
    assert det.flagged("j") == []


def test_noise_is_not_flagged():
    det = StragglerDetector()
    events = _drive(det, Job(ranks=8, noise=0.05, seed=3), 200)
    assert events == []
    assert max(s.score for s in det.scores()["j"].values()) < 1.1


def test_peers_are_compared_within_their_group():
    # pipeline stages do different work by design: stage 1 computes 1.5x more than stage 0
    det = StragglerDetector(StragglerConfig(window_steps=20))
    job = Job(ranks=4, noise=0.02)
    job.compute.update({2: 0.3, 3: 0.3})
    groups = {0: 0, 1: 0, 2: 1, 3: 1}
    assert _drive(det, job, 30, groups=groups) == []
    # without the grouping the heavier stage would be flagged
    det2 = StragglerDetector(StragglerConfig(window_steps=20))
    job2 = Job(ranks=4, noise=0.02)
    job2.compute.update({2: 0.3, 3: 0.3})
    flagged = {e.rank for e in _drive(det2, job2, 30) if e.started}
    assert flagged == {2, 3}


def test_high_compute_without_making_others_wait_is_not_a_straggler():
    # rank 1's "compute" is high but it also waits as much as its peers: an accounting artefact
    det = StragglerDetector(StragglerConfig(window_steps=10, persist=2))
    c = {r: [0, 0.0, 0.0] for r in range(3)}
    events = []
    for _ in range(30):
        for r in c:
            c[r][0] += 5
            c[r][1] += 5 * 0.5
            c[r][2] += 5 * (0.1 if r != 1 else 0.1)  # same wait ...
        c[1][1] += 5 * 0.2                            # ... but longer steps reported
        events += det.update("j", {r: RankSample(*v) for r, v in c.items()})
    assert events == [] and det.scores()["j"][1].score > 1.3


def test_samples_are_kept_only_when_the_wait_total_moves():
    det = StragglerDetector(StragglerConfig(window_steps=10))
    # steps arrive, the wait total lags (collectives come every few seconds)
    det.update("j", {0: RankSample(10, 3.0, 1.0), 1: RankSample(10, 3.0, 1.0)})
    det.update("j", {0: RankSample(14, 4.2, 1.0), 1: RankSample(14, 4.2, 1.0)})   # ignored: wait unchanged
    events = det.update("j", {0: RankSample(20, 6.0, 2.0), 1: RankSample(20, 6.0, 2.0)})
    assert events == []
    s = det.scores()["j"][0]
    assert s.compute_per_step_s == pytest.approx(0.2) and s.wait_per_step_s == pytest.approx(0.1)


def test_counters_going_back_restart_the_history_and_forget():
    det = StragglerDetector(StragglerConfig(window_steps=10))
    job = Job(ranks=2)
    _drive(det, job, 5)
    det.update("j", {0: RankSample(1, 0.2, 0.0), 1: RankSample(1, 0.2, 0.0)})
    det.forget("j")
    assert det.scores() == {}

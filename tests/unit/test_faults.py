import signal

import pytest

from trainwarden.runtime.faults import FaultInjector, FaultSpecError, InjectedFault, parse_faults

pytestmark = pytest.mark.timeout(30)

SPEC = "crash:rank=3,step=12;stop:rank=1,step=40;hang:rank=2,step=30;slow:rank=0,from=10,until=60,factor=1.3"


def test_parse_issue_example():
    faults = parse_faults(SPEC)
    assert [f.kind for f in faults] == ["crash", "stop", "hang", "slow"]
    assert faults[0].rank == 3 and faults[0].step == 12
    slow = faults[3]
    assert (slow.start, slow.until, slow.factor) == (10, 60, 1.3)


@pytest.mark.parametrize(
    "spec, words",
    [
        ("explode:rank=1,step=2", "unknown kind 'explode'"),
        ("crash:rank=1,step=2,when=3", "unknown key 'when'"),
        ("crash:rank=1", "missing step"),
        ("crash:rank=x,step=2", "'x' is not an integer"),
        ("crash:rank=1,step", "expected key=value"),
        ("slow:rank=0,from=10,factor=0.5", "factor must be >= 1.0"),
        ("slow:rank=0,from=10,until=5,factor=2", "until (5) must be greater than from (10)"),
        ("crash:rank=1,step=2,repeat=yes", "repeat must be 0 or 1"),
    ],
)
def test_bad_specs_name_the_problem(spec, words):
    with pytest.raises(FaultSpecError, match=None) as err:
        parse_faults(spec)
    assert words in str(err.value)
    assert spec.split(";")[0] in str(err.value)


class Recorder:
    def __init__(self):
        self.kills, self.sleeps, self.blocks = [], [], 0

    def kill(self, pid, sig):
        self.kills.append(sig)

    def sleep(self, seconds):
        self.sleeps.append(seconds)

    def block(self):
        self.blocks += 1


def injector(spec, rank, tmp_path=None, restart_count=0):
    rec = Recorder()
    inj = FaultInjector(parse_faults(spec), rank=rank, state_dir=tmp_path, restart_count=restart_count,
                        kill=rec.kill, sleep=rec.sleep, block=rec.block)
    return inj, rec


def test_only_own_rank_and_step(tmp_path):
    inj, rec = injector(SPEC, rank=3, tmp_path=tmp_path)
    for step in range(20):
        inj.step_boundary(step, 0.1)
    assert rec.kills == [signal.SIGKILL]


def test_stop_and_hang(tmp_path):
    inj, rec = injector(SPEC, rank=1, tmp_path=tmp_path)
    inj.step_boundary(40)
    assert rec.kills == [signal.SIGSTOP]
    inj, rec = injector(SPEC, rank=2, tmp_path=tmp_path)
    inj.step_boundary(30)
    assert rec.blocks == 1


def test_fires_once_per_job_across_restarts(tmp_path):
    inj, rec = injector("crash:rank=0,step=5", rank=0, tmp_path=tmp_path)
    inj.step_boundary(5)
    # the restarted worker resumes from a checkpoint before step 5 and passes step 5 again
    inj, rec2 = injector("crash:rank=0,step=5", rank=0, tmp_path=tmp_path, restart_count=1)
    inj.step_boundary(5)
    assert rec.kills == [signal.SIGKILL] and rec2.kills == []


def test_repeat_fires_again(tmp_path):
    for restart in range(2):
        inj, rec = injector("crash:rank=0,step=5,repeat=1", rank=0, tmp_path=tmp_path, restart_count=restart)
        inj.step_boundary(5)
        assert rec.kills == [signal.SIGKILL]


def test_without_state_dir_only_first_round():
    inj, rec = injector("crash:rank=0,step=5", rank=0, restart_count=0)
    inj.step_boundary(5)
    inj2, rec2 = injector("crash:rank=0,step=5", rank=0, restart_count=1)
    inj2.step_boundary(5)
    assert rec.kills == [signal.SIGKILL] and rec2.kills == []


def test_slow_window_scales_with_step_time():
    inj, rec = injector("slow:rank=0,from=10,until=12,factor=1.5", rank=0)
    for step in range(9, 14):   # the measured step includes what was injected into it
        inj.step_boundary(step, 0.2 + (rec.sleeps[-1] if step in (11, 12) else 0.0))
    assert rec.sleeps == pytest.approx([0.1, 0.1])


def test_slow_delay_does_not_compound():
    inj, rec = injector("slow:rank=0,from=1,factor=2", rank=0)
    last = 0.2
    for step in range(1, 6):   # each step: 0.2 s of work plus the injected delay
        inj.step_boundary(step, last)
        last = 0.2 + (rec.sleeps[-1] if rec.sleeps else 0.0)
    assert rec.sleeps == pytest.approx([0.2] * 5)   # twice as slow, not ever slower


def test_exception_fault():
    inj, _ = injector("exception:rank=0,step=1", rank=0)
    with pytest.raises(InjectedFault):
        inj.step_boundary(1)


def test_from_env_without_spec_is_disarmed():
    inj = FaultInjector.from_env(rank=0, env={})
    assert not inj.armed
    inj.step_boundary(0, 1.0)


def test_slow_save_blocks_the_save_of_its_step_once(tmp_path):
    inj, rec = injector("slow_save:rank=0,step=20,seconds=12", rank=0, tmp_path=tmp_path)
    inj.step_boundary(20, 0.3)
    inj.before_save(10)
    inj.before_save(20)
    inj.before_save(20)
    assert rec.sleeps == [12.0] and rec.kills == []


def test_slow_save_needs_positive_seconds():
    with pytest.raises(FaultSpecError, match="seconds must be > 0"):
        parse_faults("slow_save:rank=0,step=2,seconds=0")

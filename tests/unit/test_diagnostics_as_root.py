"""The watchdog reads the ranks' hang diagnostics as root without trusting them (issue 44, round 2).

A root agent's watchdog gives a hang's fresh diagnostics directory to the job's uid (so its workers can write their
dumps) and then reads ``rank<R>.stacks`` and ``rank<R>.fr`` from it. A real second uid (``nobody``, a forked child
that dropped to it) plants what a job's user could: a FIFO, links to a root-only file and to ``/dev/zero``; root's
own file stands in for another uid's. Before the change the stacks were read with a plain ``open``: the FIFO
blocked the watchdog for good, and a link was followed.
"""

from __future__ import annotations

import os
import pickle
import shutil
import threading
import traceback

import pytest

from trainwarden.agent.shared.contract import stacks_file, trace_file
from trainwarden.agent.watchdog.culprit import give_to_writers, name_culprit, read_diagnostics
from job_users import shared_dir

NOBODY_UID = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="reads files a second uid planted, as root: needs root")

_SECRET = 'Thread 0x00007f0000000001 (most recent call first):\n  File "/root-only/SECRET-LINE", line 1 in secret\n'


def _stacks(func: str) -> str:
    return f'Thread 0x00007f0000000002 (most recent call first):\n  File "/job/train.py", line 7 in {func}\n'


def _trace(seq: int, in_flight: bool) -> bytes:
    entry = {"process_group": ("0", "default_pg"), "pg_id": 0, "collective_seq_id": seq, "is_p2p": False,
             "profiling_name": "nccl:all_reduce", "retired": not in_flight,
             "state": "started" if in_flight else "completed"}
    return pickle.dumps({"entries": [entry]})


def _as_nobody(plant) -> None:
    """Run ``plant`` in a forked child that dropped to ``nobody`` (no exec: the interpreter's path is not needed)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY_UID)
            os.setuid(NOBODY_UID)
            plant()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "planting as nobody failed"


def _read_within(seconds: float, *args, **kwargs):
    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(read_diagnostics(*args, **kwargs)), daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail("the diagnostics read blocked (a FIFO opened without O_NONBLOCK)")
    return outcome[0]


@pytest.fixture
def shared():
    path = shared_dir("trainwarden-diag-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def hang_dir(shared):
    """``<records>/j/diagnostics/<incident>`` made by root and given to nobody, as the watchdog does on a hang; a
    root-only secret outside it."""
    tmp_path = shared
    secret_dir = tmp_path / "root-only"
    secret_dir.mkdir(mode=0o700)
    (secret_dir / "stacks").write_text(_SECRET)
    (secret_dir / "dump.fr").write_bytes(_trace(99, False))
    records = tmp_path / "records"
    records.mkdir()
    records.chmod(0o755)
    directory = records / "j" / "diagnostics" / "20261129-hang"
    directory.mkdir(parents=True)
    for d in (records / "j", records / "j" / "diagnostics"):
        d.chmod(0o755)
    give_to_writers(directory, NOBODY_UID)
    return directory, secret_dir


def test_planted_fifos_and_links_neither_block_nor_are_followed_and_the_hang_is_still_named(hang_dir):
    directory, secret_dir = hang_dir
    assert os.stat(directory).st_uid == NOBODY_UID  # the workers of the job's uid can write their dumps

    def plant():
        (directory / stacks_file(0)).write_text(_stacks("all_reduce_wait"))  # rank 0 waits in collective #5
        (directory / trace_file(0)).write_bytes(_trace(5, True))
        (directory / stacks_file(1)).write_text(_stacks("load_batch"))  # rank 1 never entered it: the culprit
        (directory / trace_file(1)).write_bytes(_trace(4, False))
        os.mkfifo(directory / stacks_file(2))  # a FIFO: a plain open blocked root for good
        os.mkfifo(directory / trace_file(2))
        os.symlink(secret_dir / "stacks", directory / stacks_file(3))  # root-only files through links
        os.symlink(secret_dir / "dump.fr", directory / trace_file(3))
        os.symlink("/dev/zero", directory / stacks_file(4))

    _as_nobody(plant)
    (directory / stacks_file(5)).write_text(_SECRET)  # a file of another uid (root's) than the job's
    fds = len(os.listdir("/proc/self/fd"))

    found = _read_within(10, directory, range(6), uid=NOBODY_UID)

    assert sorted(found) == [0, 1]
    assert found[1].stack == ("load_batch (/job/train.py:7)",)
    assert "SECRET" not in repr(found)
    assert len(os.listdir("/proc/self/fd")) == fds  # no descriptor left open
    verdict = name_culprit(found)
    assert verdict.culprits == (1,), verdict.summary
    assert "rank 1 never entered all_reduce #5" in verdict.summary


def test_the_diagnostics_directory_itself_is_never_read_through_a_link(hang_dir, tmp_path):
    directory, secret_dir = hang_dir
    (secret_dir / stacks_file(0)).write_text(_stacks("secret"))
    link = tmp_path / "linked"
    link.symlink_to(secret_dir)
    assert _read_within(10, link, [0], uid=0) == {}


def test_only_a_directory_of_its_own_is_given_to_the_job(tmp_path):
    """The hand-over of a hang's directory is by descriptor: a link in its place is refused, not followed."""
    root_only = tmp_path / "root-only"
    root_only.mkdir(mode=0o700)
    link = tmp_path / "hang"
    link.symlink_to(root_only)
    with pytest.raises(OSError):
        give_to_writers(link, NOBODY_UID)
    assert os.stat(root_only).st_uid == 0
    give_to_writers(root_only, None)  # no verified owner: nothing changes hands
    give_to_writers(root_only, 0)
    assert os.stat(root_only).st_uid == 0


def test_a_root_watchdog_hands_the_hang_directory_to_the_jobs_uid_and_names_the_culprit_past_a_fifo(shared):
    """The watchdog itself (root) on a job whose streams the kernel verified as ``nobody``: it gives the hang's
    directory to nobody, whose workers (a child dropped to nobody) write their dumps there and a FIFO for a rank that
    never answers; the hang is recorded with its culprit and nothing blocks. Before, the directory stayed root's:
    nobody's workers could write nothing."""
    from test_watchdog import Actions, Sim, _watchdog

    from trainwarden.agent.telemetry.job_telemetry import WorkerInfo

    class VerifiedSim(Sim):
        def connect(self, pid_base):
            self.seq = 0
            for r in range(self.ranks):
                self.js.connect(WorkerInfo(job="j", rank=r, local_rank=r, world_size=self.ranks, mesh=self.mesh,
                                           pid=pid_base + r, hostname=f"host{r}", verified=True, uid=NOBODY_UID))

    class NobodysWorkers(Actions):
        def request_diagnostics(self, job, ranks, directory):
            def plant():
                Actions.request_diagnostics(self, job, ranks, directory)
                os.mkfifo(directory / stacks_file(2))
            _as_nobody(plant)
            self.requests.append((job, list(ranks), directory))
            return [r for r in ranks if r in self.answer]

    sim = VerifiedSim()
    assert sim.js.snapshot("j")[0].ranks[0].verified
    actions = NobodysWorkers(answer={0, 1, 3}, lagging=1)
    wd = _watchdog(sim, actions, shared)
    for _ in range(10):
        sim.run(2)
        wd.check_once()
    sim.clock.now += 5.5
    done = threading.Thread(target=wd.check_once, daemon=True)
    done.start()
    done.join(30)
    assert not done.is_alive(), "the watchdog blocked on the planted FIFO"
    (_, _, directory), = actions.requests
    assert os.stat(directory).st_uid == NOBODY_UID and os.stat(directory.parent).st_uid == 0
    opened = actions.records[0]
    assert opened.ranks == (1,) and opened.evidence["verdict"]["culprits"] == [1]

"""The launcher's exit clock stamps real processes' exits in the order they happen."""

import subprocess
import sys
import time

import pytest

from trainwarden.agent.launch.exit_clock import ExitClock

pytestmark = pytest.mark.timeout(30)


def test_exits_are_stamped_in_the_order_they_happen():
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
             for _ in range(3)]
    clock = ExitClock()
    try:
        clock.watch(p.pid for p in procs)
        for p in (procs[2], procs[0]):
            p.kill()
            p.wait()
            while clock.exited_at(p.pid) is None:  # the pytest timeout bounds it
                time.sleep(0.01)
        assert clock.exited_at(procs[2].pid) < clock.exited_at(procs[0].pid)
        assert clock.exited_at(procs[1].pid) is None  # still running
    finally:
        clock.close()
        for p in procs:
            p.kill()
            p.wait()


def test_a_process_that_is_already_gone_has_no_time():
    clock = ExitClock()
    try:
        p = subprocess.Popen([sys.executable, "-c", "pass"])
        p.wait()
        clock.watch([p.pid])
        assert clock.exited_at(p.pid) is None
    finally:
        clock.close()


def test_an_exit_wakes_a_waiter_once():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    clock = ExitClock()
    try:
        clock.watch([proc.pid])
        assert clock.wait_for_exit(0.01) is False  # nothing exited yet
        proc.kill()
        assert clock.wait_for_exit(60) is True  # the pytest timeout (30 s) would end a wait that missed it
        assert clock.exited_at(proc.pid) is not None
        assert clock.wait_for_exit(0.01) is False  # that exit was told once
    finally:
        clock.close()
        proc.kill()
        proc.wait()

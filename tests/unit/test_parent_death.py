"""exec_dying_with_parent: the child dies with the process that started it, never with a thread of it.

The parent-death signal follows the *thread* that forked the child. An etcd restarted from a timer thread
(tests/integration/test_rendezvous.py::test_store_wait_rides_out_an_etcd_restart) got SIGTERM as soon as
the timer returned: the store's wait then ran out against a dead server about one run in ten."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from trainwarden.agent.shared.parent_death import exec_dying_with_parent

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's")]

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_from_the_main_thread_the_command_is_wrapped():
    assert exec_dying_with_parent(SLEEPER)[-len(SLEEPER):] == SLEEPER
    assert len(exec_dying_with_parent(SLEEPER)) > len(SLEEPER)


def test_a_child_started_from_a_short_lived_thread_outlives_the_thread():
    started = []

    def start():  # like EmbeddedEtcd.restart on a timer: the thread lives on until the child is up
        started.append(subprocess.Popen(exec_dying_with_parent(SLEEPER), start_new_session=True))
        time.sleep(1.0)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    child = started[0]
    try:
        time.sleep(1.0)  # a parent-death signal for the thread's end would have come by now
        assert child.poll() is None
    finally:
        child.kill()
        child.wait(10)

"""CUDA step timing (runtime/cuda_timing.py) on a fake event API that behaves like torch.cuda.Event on a
stream the test advances: `query()` is False until the GPU has passed the event, `elapsed_time` raises
before both events completed (cudaErrorNotReady), and `synchronize()` fails the test."""

import threading
import time

import pytest

from trainwarden.runtime import session as session_module
from trainwarden.runtime.agent_client import STEP_RECORD
from trainwarden.runtime.cuda_timing import CudaStepTimer


class FakeStream:
    """The GPU: work is enqueued in order and finished up to a point the test moves (`run_until`)."""

    def __init__(self):
        self.enqueued = 0
        self.finished = 0
        self.gpu_ms: dict[int, float] = {}  # position -> GPU time when it finishes
        self._lock = threading.Lock()

    def enqueue(self):
        with self._lock:
            self.enqueued += 1
            return self.enqueued

    def run_until(self, position, at_ms):
        with self._lock:
            for p in range(self.finished + 1, position + 1):
                self.gpu_ms[p] = at_ms
            self.finished = max(self.finished, position)


class FakeEvent:
    def __init__(self, stream, fail_record=False):
        self.stream, self.position, self.fail_record = stream, None, fail_record

    def record(self, stream=None):
        if self.fail_record:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.position = self.stream.enqueue()

    def query(self):
        return self.position is not None and self.stream.finished >= self.position

    def elapsed_time(self, end):
        if not (self.query() and end.query()):
            raise RuntimeError("CUDA error: device not ready")
        return self.stream.gpu_ms[end.position] - self.stream.gpu_ms[self.position]

    def synchronize(self):
        raise AssertionError("the step timer must never synchronize")


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.002)


def record(index, cpu_ns=1_000):
    return (STEP_RECORD, index, 1_700_000_000_000_000_000 + index, cpu_ns, 0, None)


@pytest.mark.timeout(20)
def test_steps_leave_in_order_with_the_gpus_duration_once_the_gpu_has_finished_them():
    stream, emitted = FakeStream(), []
    timer = CudaStepTimer(emitted.append, new_event=lambda: FakeEvent(stream), pool_size=4, poll_s=0.001)
    try:
        for i in range(3):  # the CPU enqueues three steps at once: nothing waits for the GPU
            timer.end(timer.begin(), record(i))
        assert stream.enqueued == 6 and timer.pending == 3
        time.sleep(0.02)
        assert emitted == []  # the GPU has not reached the first step's end
        stream.run_until(1, at_ms=0.0)      # step 0 starts
        stream.run_until(2, at_ms=250.0)    # ... and ends 250 ms later (a GPU step far longer than its enqueue)
        wait_for(lambda: len(emitted) == 1)
        assert emitted[0] == record(0, cpu_ns=250_000_000)
        stream.run_until(4, at_ms=400.0)
        stream.run_until(6, at_ms=1000.0)
        wait_for(lambda: len(emitted) == 3)
        assert [r[1] for r in emitted] == [0, 1, 2]
        assert [r[3] for r in emitted] == [250_000_000, 0, 0]  # steps 1 and 2 are seen at their end
        assert timer.resolved == 3 and timer.cpu_timed == 0
    finally:
        assert timer.close(timeout=1.0)


@pytest.mark.timeout(20)
def test_a_cpu_further_ahead_than_the_pool_keeps_cpu_times_and_the_order():
    stream, emitted = FakeStream(), []
    timer = CudaStepTimer(emitted.append, new_event=lambda: FakeEvent(stream), pool_size=2, poll_s=0.001)
    try:
        tokens = [timer.begin() for _ in range(3)]
        assert tokens[2] is None  # the pool is empty: no wait, no new event
        for i, token in enumerate(tokens):
            timer.end(token, record(i, cpu_ns=7))
        time.sleep(0.02)
        assert emitted == []  # the CPU-timed third step waits behind the two the GPU has not finished
        stream.run_until(4, at_ms=5.0)
        wait_for(lambda: len(emitted) == 3)
        assert [r[1] for r in emitted] == [0, 1, 2] and emitted[2][3] == 7
        assert (timer.resolved, timer.cpu_timed) == (2, 1)
        # the pairs came back: the next step is timed on the GPU again
        assert timer.begin() is not None
    finally:
        timer.close(timeout=0.5)


@pytest.mark.timeout(20)
def test_a_failing_event_never_raises_into_the_step():
    emitted = []
    stream = FakeStream()
    timer = CudaStepTimer(emitted.append, new_event=lambda: FakeEvent(stream, fail_record=True), pool_size=2,
                          poll_s=0.001)
    try:
        token = timer.begin()
        assert token is None
        timer.end(token, record(0, cpu_ns=9))
        wait_for(lambda: emitted == [record(0, cpu_ns=9)])
        assert timer.cpu_timed == 1
    finally:
        timer.close(timeout=0.5)


class StubClient:
    def __init__(self):
        self.records, self.hellos = [], []

    def record(self, item):
        self.records.append(item)

    def update_hello(self, **kw):
        self.hellos.append(kw)


@pytest.mark.timeout(20)
def test_the_session_times_steps_on_the_gpu_once_cuda_is_in_use_and_says_which_gpu(monkeypatch):
    stream = FakeStream()
    in_use = [False]
    monkeypatch.setattr(session_module, "cuda_in_use", lambda: in_use[0])
    monkeypatch.setattr(session_module, "gpu_uuid", lambda: "GPU-5ed1e2a4-0b5c-4c1e-9f3a-1d2e3f405162")
    monkeypatch.setattr(session_module, "CudaStepTimer",
                        lambda emit: CudaStepTimer(emit, new_event=lambda: FakeEvent(stream), poll_s=0.001))
    s = session_module.Session(job="j", rank=0, world_size=1, client_config=None)
    client = s._client = StubClient()
    s._manual_steps = True
    try:
        with s.step(0):
            pass
        assert [r[1] for r in client.records] == [0] and s._cuda is None  # no CUDA: CPU time, at once
        in_use[0] = True
        with s.step(1):
            pass
        assert client.hellos == [{"mesh": None, "step_source": None,
                                  "gpu_uuid": "GPU-5ed1e2a4-0b5c-4c1e-9f3a-1d2e3f405162"}]
        with pytest.raises(ValueError):
            with s.step(2):
                raise ValueError("a step that raised is not progress")
        time.sleep(0.02)
        assert [r[1] for r in client.records] == [0]  # step 1 waits for the GPU
        stream.run_until(stream.enqueued, at_ms=80.0)
        wait_for(lambda: len(client.records) == 2)
        assert client.records[1][1] == 1 and s._cuda.resolved == 1
    finally:
        s._cuda.close(timeout=0.5)
        s._client = None

"""The output pump: a full disk under run.log costs the log, never the progress or the terminal."""

import errno
import io

import pytest

from trainwarden.agent.launch.output import OutputPump

pytestmark = pytest.mark.timeout(20)


class FullDisk(io.StringIO):
    name = "/state/jobs/j/logs/run.log"

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_an_unwritable_log_is_said_once_and_everything_downstream_goes_on():
    lines = [b"step 1 loss 5.0 time 0.1s\n", b"I1122 14:37:14.328000 123 api.py:1] torchrun chatter\n",
             b"step 2 loss 4.0 time 0.1s\n"]
    terminal, seen = io.StringIO(), []
    pump = OutputPump(io.BytesIO(b"".join(lines)), terminal, FullDisk(), seen.append)
    pump.run()
    assert seen == [line.decode() for line in lines]  # progress and incidents still fed
    text = terminal.getvalue()
    assert text.count("cannot write the job's log /state/jobs/j/logs/run.log: No space left on device") == 1
    assert "step 1 loss" in text and "step 2 loss" in text and "torchrun chatter" not in text
    assert pump.log_error.errno == errno.ENOSPC


def test_a_broken_terminal_does_not_stop_the_log():
    class Broken(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    log, seen = io.StringIO(), []
    OutputPump(io.BytesIO(b"a\nb\n"), Broken(), log, seen.append).run()
    assert log.getvalue() == "a\nb\n" and seen == ["a\n", "b\n"]

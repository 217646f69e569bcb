"""A warm worker dies with its zygote even when the zygote died between the fork and the worker's request for the
parent-death signal (runtime/zygote.py ``_become``). Before, the worker asked without checking its parent: forked
by a zygote SIGKILLed at that moment (with its launcher, or a node's kill), it ran the user's script on as an
orphan, holding its rank's resources, and nothing in the job would ever stop it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)


def test_a_worker_whose_zygote_is_already_gone_dies_before_the_script_runs(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('the orphan ran the script')\n")
    # The child takes a job as a forked worker would, but names a zygote that is not its parent (the zygote
    # died and the worker was reparented): the parent check must end it before anything of the job runs.
    child = textwrap.dedent(f"""
        import os, sys
        from trainwarden.runtime import zygote
        r, w = os.pipe()
        job = zygote._Job({{"env": dict(os.environ), "cwd": {str(tmp_path)!r}, "argv": [{str(script)!r}]}},
                          [os.open(os.devnull, os.O_RDONLY), os.open(os.devnull, os.O_WRONLY),
                           os.open(os.devnull, os.O_WRONLY)], parent=os.getppid() + 1_000_000)
        zygote._become(job)
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=50)
    assert out.returncode == -9, (out.returncode, out.stderr)
    assert not marker.exists()


def test_a_worker_whose_zygote_lives_runs_the_script(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    child = textwrap.dedent(f"""
        import os
        from trainwarden.runtime import zygote
        job = zygote._Job({{"env": dict(os.environ), "cwd": {str(tmp_path)!r}, "argv": [{str(script)!r}]}},
                          [os.open(os.devnull, os.O_RDONLY), os.open(os.devnull, os.O_WRONLY),
                           os.open(os.devnull, os.O_WRONLY)], parent=os.getppid())
        zygote._become(job)
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=50,
                         env={**os.environ, "TRAINWARDEN_AUTO_INSTRUMENT": "0"})
    assert out.returncode == 0, out.stderr
    assert marker.read_text() == "ran"

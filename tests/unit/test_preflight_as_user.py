"""The daemon's checks before a launch run as the job's user (issue 44, item 9): a refusal must not tell the
submitter whether a path only root may see exists. Real: a root process checks a spec for ``nobody`` in a child
that dropped to ``nobody`` (in a mount namespace where the interpreter is reachable, tests/job_users.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from job_users import interpreter_for_others, shared_dir, unavailable

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=str(unavailable()))

_CHECK = """
import json, sys
from trainwarden.agent.common.job_spec import JobSpec
from trainwarden.agent.node.job_refusal import node_problems
from trainwarden.agent.node.job_user import resolve_job_user
nobody = resolve_job_user("nobody", default=None, allow_root=False)
out = {}
for name, script in json.loads(sys.argv[1]).items():
    spec = JobSpec(name="j", command=(script,))
    out[name] = node_problems(spec, user=nobody, python=sys.executable)
print(json.dumps(out))
"""


def test_a_root_only_script_is_refused_as_if_it_did_not_exist():
    top = shared_dir("tw-preflight-")
    try:
        private = top / "private"
        private.mkdir(mode=0o700)
        (private / "secret.py").write_text("print('root only')\n")
        (top / "train.py").write_text("print('hi')\n")
        scripts = {"hidden": str(private / "secret.py"), "absent": str(private / "absent.py"),
                   "visible": str(top / "train.py")}
        run = subprocess.run([*interpreter_for_others(), sys.executable, "-c", _CHECK, json.dumps(scripts)],
                             capture_output=True, text=True, timeout=120, cwd=str(top))
        assert run.returncode == 0, run.stderr
        found = json.loads(run.stdout)
        assert found["visible"] == []
        assert found["hidden"] and found["absent"], found  # before: root saw secret.py, so only absent.py failed
        assert found["hidden"][0].replace("secret.py", "X") == found["absent"][0].replace("absent.py", "X")
    finally:
        shutil.rmtree(top, ignore_errors=True)

"""`trainwarden report` on a real faulted run, opened in a real headless Chromium: every chart renders and the
page logs nothing to the console (agent/report/).

Chromium forwards every console message of a page to its stderr (``--enable-logging=stderr``), whatever its level,
as ``[...:INFO:CONSOLE:<line>] "<message>", source: <url> (<line>)``: a ``console.error`` and an uncaught exception
(``"Uncaught ReferenceError: ..."``) alike. The check is that no such line names the page; it is first shown to
catch a deliberately broken page, so a Chromium that stopped printing them fails here instead of passing.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gpt_helpers import gpt_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
JOB = "report"


def open_in_chromium(page: Path, profile: Path, timeout: float = 120) -> tuple[str, list[str]]:
    """Load ``page`` in headless Chromium (its own session and a fresh profile; the session is killed whatever
    happens): the DOM after the page's scripts ran, and the console lines that name the page."""
    cmd = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--enable-logging=stderr",
           "--v=0", f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--dump-dom", page.as_uri()]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, errors="replace", start_new_session=True)
    try:
        dom, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
    console = [line for line in err.splitlines() if ":CONSOLE" in line and page.as_uri() in line]
    return dom, console


def leftover_chromium(profile: Path) -> list[int]:
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if any(str(profile) in arg for arg in (p.info["cmdline"] or [])):
            found.append(p.info["pid"])
    return found


@pytest.fixture
def chromium(tmp_path):
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium; `make system-packages`)")
    profile = tmp_path / "chromium-profile"
    yield lambda page: open_in_chromium(page, profile)
    left = leftover_chromium(profile)
    for pid in left:  # started by this test (its profile is on the command line)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"chromium processes outlived their session: {left}"


def test_the_console_check_catches_a_broken_page(chromium, tmp_path):
    broken = tmp_path / "broken.html"
    broken.write_text('<html><body><script>console.error("deliberate"); notDefined();</script></body></html>')
    _, console = chromium(broken)
    assert any('"deliberate"' in line for line in console), console
    assert any("Uncaught ReferenceError: notDefined is not defined" in line for line in console), console


@pytest.mark.extended  # 75-105 s (a faulted 4-rank run first); chromium stays in the default suite (the console check)
def test_the_report_of_a_faulted_run_renders_in_chromium(chromium, procs, tmp_path):
    home = tmp_path / "state"
    env = gpt_env()
    env.update(TRAINWARDEN_STATE_HOME=str(home), TRAINWARDEN_FAULTS="crash:rank=1,step=8")
    run = procs.spawn(
        [sys.executable, "-m", "trainwarden.agent.cli", "run", "--metrics-port", "0", "--nproc-per-node", "4",
         "--max-restarts", "1", "--monitor-interval", "0.5", "--job", JOB, "--",
         "-m", "trainwarden.runtime.examples.gpt", "--dp", "2", "--tp", "2", "--pp", "1", "--steps", "24",
         "--ckpt-every", "5"], log=tmp_path / "run.log", env=env)
    try:
        rc = run.wait(240)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the run did not finish in 240 s: {(tmp_path / 'run.log').read_text(errors='replace')[-3000:]}")
    assert rc == 0, (tmp_path / "run.log").read_text(errors="replace")[-3000:]

    page = tmp_path / "out" / "report.html"
    made = subprocess.run([sys.executable, "-m", "trainwarden.agent.cli", "report", "--job", JOB, "--state-home",
                           str(home), "--out", str(page)], capture_output=True, text=True, timeout=120, env=env)
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == str(page)
    text = page.read_text()
    assert "<dt>restarts</dt><dd>1</dd>" in text and "<dt>final phase</dt><dd>succeeded</dd>" in text
    assert "<td>crash</td>" in text  # the incident, in its table (and on the timeline)
    assert re.search(r"<td class=n>\d+</td><td>complete \(latest\)</td>", text)

    dom, console = chromium(page)
    assert console == [], console
    charts = text.count('class="plotly-graph-div"')
    assert charts == 2  # the step timeline and the goodput bar
    assert dom.count('class="plot-container plotly"') == charts, dom[-2000:]
    assert dom.count('class="main-svg"') >= charts
    legends = set(re.findall(r'class="legendtext"[^>]*>([^<]+)<', dom))  # drawn by plotly.js, not in the HTML
    assert {"rank 0", "rank 3", "round failed", "incident", "checkpoint", "productive"} <= legends, legends

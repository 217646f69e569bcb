"""`trainwarden status/top` formatting, socket resolution and command flow, on hand-built StatusReplies."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from fake_nvml import FakeGpu, FakeNvml
from trainwarden.agent.common import exit_codes
from trainwarden.agent.health import GpuHealthConfig, GpuHealthSampler
from trainwarden.agent.shared import telemetry_pb2 as pb
from trainwarden.agent.cli.status import (
    fetch_gpu_stats, format_status, format_top, parse_gpu_stats, status_command, status_to_json, top_command,
)
from trainwarden.agent.node.endpoints import (
    AGENT_SOCKET_RECORD, DEFAULT_SOCKET, SOCKET_ENV, AgentUnavailable, fetch_status, resolve_socket,
)

pytestmark = pytest.mark.timeout(30)


def reply() -> pb.StatusReply:
    ranks = [
        pb.RankStatus(rank=1, local_rank=1, pid=4242, hostname="n1", connected=True, last_step=120,
                      last_seen_seconds_ago=0.4, step_p50_seconds=0.212, step_p99_seconds=0.350, wait_share=0.31,
                      tokens_per_second=12345.6, restart_count=1, flags=["straggler"], straggler_score=1.374),
        pb.RankStatus(rank=0, local_rank=0, pid=4241, hostname="n1", connected=True, last_step=121,
                      last_seen_seconds_ago=0.1, step_p50_seconds=0.2, step_p99_seconds=0.25, wait_share=0.05,
                      tokens_per_second=13000.0, restart_count=1),
        pb.RankStatus(rank=2, local_rank=2, pid=0, connected=False, last_step=-1, last_seen_seconds_ago=30.0),
    ]
    job = pb.JobStatus(job="demo", world_size=4, mesh={"dp": 2, "tp": 2}, last_step=121, step_p50_seconds=0.21,
                       step_p99_seconds=0.35, tokens_per_second=25345.6, checkpoint_last_step=100, ranks=ranks,
                       flags=["straggler"])
    return pb.StatusReply(node="n1", jobs=[job])


def test_status_table_has_a_job_line_and_one_row_per_rank_in_rank_order():
    lines = format_status(reply()).splitlines()
    assert lines[0] == "node n1"
    job_line = next(line for line in lines if line.startswith("job demo"))
    assert "2/3 ranks connected  world 4" in job_line and "mesh dp=2,tp=2" in job_line
    assert "step 121" in job_line and "checkpoint 100" in job_line and "flags straggler" in job_line
    header = lines.index(job_line) + 1
    assert lines[header].split() == ["RANK", "PID", "CONNECTED", "STEP", "SEEN", "P50", "P99", "WAIT", "TOKENS/S",
                                     "SCORE", "RESTARTS", "FLAGS"]
    rows = [line.split() for line in lines[header + 1:]]
    assert [r[0] for r in rows] == ["0", "1", "2"]
    assert rows[1] == ["1", "4242", "yes", "120", "0.4s", "ago", "0.212s", "0.350s", "31%", "12,346", "1.37", "1",
                       "straggler"]
    assert rows[0][10] == "-"   # not scored yet
    assert rows[2][:4] == ["2", "-", "no", "-"]  # no pid, no step yet
    # columns are aligned: every row's STEP column starts where the header's does
    start = lines[header].index("STEP")
    assert all(line[start - 2:start] == "  " for line in lines[header:])


def test_status_without_jobs_says_so():
    assert format_status(pb.StatusReply(node="n1")) == "node n1: no jobs reporting to this agent"


def test_json_keeps_numbers_as_numbers_and_missing_steps_as_null():
    data = status_to_json(reply())
    job = data["jobs"][0]
    assert data["node"] == "n1" and job["last_step"] == 121 and job["checkpoint_last_step"] == 100
    assert job["mesh"] == {"dp": 2, "tp": 2}
    assert [r["rank"] for r in job["ranks"]] == [0, 1, 2]
    assert job["ranks"][2]["last_step"] is None and job["ranks"][1]["flags"] == ["straggler"]
    assert job["ranks"][1]["straggler_score"] == pytest.approx(1.374) and job["ranks"][0]["straggler_score"] is None
    json.dumps(data)


def test_top_frame_shows_gpu_per_local_rank_and_dashes_without_one():
    frame = format_top(reply(), {0: (0.87, 71.0), 1: (None, 45.0)}, now="12:00:00")
    rows = {line.split()[0]: line.split() for line in frame.splitlines() if line[:1].isdigit()}
    assert rows["0"][6:9] == ["-", "87%", "71C"]
    assert rows["1"][6:10] == ["1.37", "-", "45C", "straggler"]
    assert rows["2"][7:10] == ["-", "-", "disconnected"]
    assert "node n1  12:00:00" in frame.splitlines()[0]


def test_gpu_gauges_are_read_from_the_agents_real_exposition():
    gpus = GpuHealthSampler(GpuHealthConfig(node="n1"),
                            nvml=FakeNvml([FakeGpu(uuid="GPU-a"), FakeGpu(uuid="GPU-b", util_gpu=12, temperature=45)]))
    assert gpus.open()
    gpus.sample()
    registry = CollectorRegistry()
    registry.register(gpus)
    assert parse_gpu_stats(generate_latest(registry).decode()) == {0: (0.87, 71.0), 1: (0.12, 45.0)}
    assert parse_gpu_stats("") == {}


def test_unreachable_metrics_endpoint_gives_no_gpu_stats():
    assert fetch_gpu_stats("http://127.0.0.1:1/metrics", timeout=1.0) == {}


def test_socket_resolution_order(tmp_path):
    env = {SOCKET_ENV: "/env/agent.sock"}
    assert resolve_socket("/flag.sock", "demo", env=env) == Path("/flag.sock")
    assert str(resolve_socket(None, "demo", env=env, state_home=tmp_path)) == "/env/agent.sock"
    # with --job: the socket a running `trainwarden run` recorded, if it is there
    assert resolve_socket(None, "demo", env={}, state_home=tmp_path) == DEFAULT_SOCKET
    run_socket = tmp_path / "run" / "agent.sock"
    record = tmp_path / "jobs" / "demo" / AGENT_SOCKET_RECORD
    record.parent.mkdir(parents=True)
    record.write_text(f"{run_socket}\n")
    assert resolve_socket(None, "demo", env={}, state_home=tmp_path) == DEFAULT_SOCKET  # run ended: no socket
    run_socket.parent.mkdir()
    run_socket.touch()
    assert resolve_socket(None, "demo", env={}, state_home=tmp_path) == run_socket
    assert resolve_socket(None, None, env={}, state_home=tmp_path) == DEFAULT_SOCKET


def test_metrics_url_resolution_order(tmp_path):
    from trainwarden.agent.node.endpoints import AGENT_METRICS_RECORD, DEFAULT_METRICS_URL, resolve_metrics_url

    assert resolve_metrics_url("none", "demo", state_home=tmp_path) is None
    assert resolve_metrics_url("http://h:1/metrics", "demo", state_home=tmp_path) == "http://h:1/metrics"
    assert resolve_metrics_url(None, "demo", state_home=tmp_path) == DEFAULT_METRICS_URL
    record = tmp_path / "jobs" / "demo" / AGENT_METRICS_RECORD
    record.parent.mkdir(parents=True)
    record.write_text("http://127.0.0.1:40123/metrics\n")   # a run on a port it picked
    assert resolve_metrics_url(None, "demo", state_home=tmp_path) == "http://127.0.0.1:40123/metrics"
    assert resolve_metrics_url(None, None, state_home=tmp_path) == DEFAULT_METRICS_URL


def test_missing_socket_is_agent_unavailable_with_what_to_do(tmp_path):
    with pytest.raises(AgentUnavailable, match=r"no agent at unix:.*nope\.sock: start `trainwarden agent` or pass "
                                               r"--socket"):
        fetch_status(tmp_path / "nope.sock")


def unavailable(socket_path, job=None):
    raise AgentUnavailable(f"no agent at unix:{socket_path}: start `trainwarden agent` or pass --socket")


def test_status_command_prints_one_line_and_exit_5_without_an_agent(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    assert status_command(out, err, tmp_path / "a.sock", fetch=unavailable) == exit_codes.EXIT_AGENT_UNAVAILABLE == 5
    assert out.getvalue() == "" and len(err.getvalue().splitlines()) == 1


def test_status_command_json_and_unknown_job(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    asked = []
    assert status_command(out, err, tmp_path / "a.sock", job="demo", as_json=True,
                          fetch=lambda path, job: asked.append(job) or reply()) == 0
    assert json.loads(out.getvalue())["jobs"][0]["job"] == "demo" and asked == ["demo"]
    out = io.StringIO()
    assert status_command(out, err, tmp_path / "a.sock", job="other", fetch=lambda p, j: pb.StatusReply(node="n1")) == 0
    assert "job other is not reporting" in out.getvalue()


def test_top_prints_plain_frames_off_a_terminal_and_stops_after_iterations(tmp_path):
    out, err, sleeps = io.StringIO(), io.StringIO(), []
    rc = top_command(out, err, tmp_path / "a.sock", interval=2.0, iterations=3, tty=False,
                     fetch=lambda p, j: reply(), gpu_stats=lambda url: {}, sleep=sleeps.append)
    assert rc == 0 and out.getvalue().count("trainwarden top") == 3 and "\x1b[" not in out.getvalue()
    assert len(sleeps) == 2 and all(0 < s <= 2.0 for s in sleeps)


def test_top_redraws_in_place_on_a_terminal_and_ctrl_c_exits_0(tmp_path):
    out, err = io.StringIO(), io.StringIO()

    def interrupt(seconds):
        raise KeyboardInterrupt

    rc = top_command(out, err, tmp_path / "a.sock", tty=True, metrics_url=None, fetch=lambda p, j: reply(),
                     sleep=interrupt)
    assert rc == 0 and out.getvalue().startswith("\x1b[H\x1b[2J") and err.getvalue() == ""


def test_top_exits_5_when_no_agent_at_start_and_keeps_going_when_it_goes_away(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    assert top_command(out, err, tmp_path / "a.sock", iterations=2, tty=False, fetch=unavailable,
                       sleep=lambda s: None) == exit_codes.EXIT_AGENT_UNAVAILABLE
    calls = []

    def flaky(path, job):
        calls.append(path)
        if len(calls) > 1:
            unavailable(path)
        return reply()

    out = io.StringIO()
    rc = top_command(out, err, tmp_path / "a.sock", iterations=2, tty=False, metrics_url=None, fetch=flaky,
                     sleep=lambda s: None)
    first, second = out.getvalue().split("trainwarden top")[1:]
    assert rc == 0 and "job demo" in first and "agent unreachable, retrying" in second and "job demo" not in second


def test_a_recorded_metrics_url_other_than_a_launchers_own_is_not_used(tmp_path):
    """Issue 44, item 3: `top --job J` run by root fetched whatever URL the job's user wrote in its record."""
    import os

    from trainwarden.agent.node.endpoints import AGENT_METRICS_RECORD, DEFAULT_METRICS_URL, resolve_metrics_url

    secret = tmp_path / "secret"
    secret.write_text("root-only\n")
    record = tmp_path / "jobs" / "demo" / AGENT_METRICS_RECORD
    record.parent.mkdir(parents=True)
    for planted in (f"file://{secret}", "http://10.1.2.3:80/metrics", "http://127.0.0.1:40123/admin"):
        record.write_text(planted + "\n")
        assert resolve_metrics_url(None, "demo", state_home=tmp_path) == DEFAULT_METRICS_URL, planted
    record.unlink()
    os.symlink(secret, record)  # a link to a file of root's: not followed
    assert resolve_metrics_url(None, "demo", state_home=tmp_path) == DEFAULT_METRICS_URL
    record.unlink()
    os.mkfifo(record)  # a FIFO: not waited on
    assert resolve_metrics_url(None, "demo", state_home=tmp_path) == DEFAULT_METRICS_URL

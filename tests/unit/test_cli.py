"""The `trainwarden` command line: subcommand wiring, parser errors, exit codes, and the deploy/ examples."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainwarden.agent.common import exit_codes
from trainwarden.agent.cli.main import build_parser, main
from trainwarden.agent.incidents import Incident, IncidentKind, IncidentStore, new_incident_id
from trainwarden.agent.common.paths import job_state_dir

pytestmark = pytest.mark.timeout(30)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_no_command_prints_help_and_exits_usage(capsys):
    assert main([]) == exit_codes.EXIT_USAGE
    out = capsys.readouterr().out
    assert all(name in out for name in ("run", "status", "top", "incidents", "agent"))


@pytest.mark.parametrize("argv, message", [
    (["top", "--interval", "0"], "must be more than 0"),
    (["top", "--interval", "soon"], "is not a number of seconds"),
    (["top", "--iterations", "0"], "must be at least 1"),
    (["status", "--verbose"], "unrecognized arguments: --verbose"),
    (["agent", "--metrics-port", "http"], "invalid int value"),
    (["incidents", "show"], "the following arguments are required: ID"),
])
def test_parser_errors_exit_usage(capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == exit_codes.EXIT_USAGE
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["agent", "--socket", "/tmp/agent.sock", "--metrics-port", "70000"], "metrics port 70000 is not a TCP port"),
    (["agent", "--socket", "/tmp/agent.sock", "--health-port", "70000"], "health port 70000 is not a TCP port"),
    (["agent", "--socket", "/tmp/" + "x" * 120 + ".sock"], "choose a shorter --socket"),
    (["agent", "--socket", "/tmp/agent.sock", "--etcd", "etcd-host"], "expected HOST:PORT"),
    (["agent", "--socket", "/proc/no-such-dir/agent.sock", "--metrics-port", "0", "--metrics-host", "127.0.0.1"],
     "cannot create the socket /proc/no-such-dir/agent.sock"),
])
def test_bad_agent_configuration_is_one_line_and_exit_usage(capsys, argv, message):
    assert main(argv) == exit_codes.EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("key, message", [
    ("RANK", "torchrun sets it for each worker"),
    ("TRAINWARDEN_AGENT_SOCKET", "it sets its TRAINWARDEN_* variables"),
    ("TRAINWARDEN_JOB", "name the job with --job"),
    ("NOTIFY_SOCKET", "systemd notification socket"),
])
def test_run_refuses_env_that_trainwarden_or_torchrun_sets(capsys, key, message):
    """What a job spec's [env] may not set, `trainwarden run --env` may not either: it would override the
    variable for every worker (the agent socket, the rank) and break the job quietly."""
    assert main(["run", "--env", f"{key}=x", "--", "train.py"]) == exit_codes.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"--env {key}: it" in err and message in err and len(err.strip().splitlines()) == 1


def test_unreachable_etcd_is_one_line_and_exit_etcd_unavailable(capsys, tmp_path):
    argv = ["agent", "--socket", str(tmp_path / "a.sock"), "--metrics-port", "0", "--etcd", "127.0.0.1:1"]
    assert main(argv) == exit_codes.EXIT_ETCD_UNAVAILABLE
    assert capsys.readouterr().err.startswith("trainwarden agent: cannot reach etcd at 127.0.0.1:1")
    assert not (tmp_path / "a.sock").exists()


def test_status_top_and_check_without_an_agent_exit_5_with_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("TRAINWARDEN_AGENT_SOCKET", raising=False)
    missing = str(tmp_path / "a.sock")
    for argv in (["status", "--socket", missing], ["top", "--socket", missing, "--iterations", "1"],
                 ["agent", "--check", "--socket", missing]):
        assert main(argv) == exit_codes.EXIT_AGENT_UNAVAILABLE
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"trainwarden: no agent at unix:{missing}: start `trainwarden agent` or pass --socket"]


def test_status_reads_the_socket_from_the_environment(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWARDEN_AGENT_SOCKET", str(tmp_path / "env.sock"))
    assert main(["status"]) == exit_codes.EXIT_AGENT_UNAVAILABLE
    assert f"unix:{tmp_path / 'env.sock'}" in capsys.readouterr().err


def test_agent_defaults_match_the_deployment_contract():
    from trainwarden.agent.cli.agent import resolve_settings
    from trainwarden.agent.node.endpoints import DEFAULT_SOCKET

    args = build_parser().parse_args(["agent"])
    s = resolve_settings(args, environ={})
    assert (s["socket"], s["metrics_host"], s["metrics_port"]) == (str(DEFAULT_SOCKET), "0.0.0.0", 9478)
    assert s["etcd"] is None and not args.check
    assert s["health_port"] is None and s["health_host"] == "127.0.0.1"  # off; loopback when asked for


def test_hang_floor_is_a_setting_of_the_agent_and_an_option_of_run(tmp_path):
    from trainwarden.agent.cli.agent import resolve_settings
    from trainwarden.agent.launch.run import RunOptions
    from trainwarden.agent.node.agent import watchdog_config
    from trainwarden.agent.watchdog.hang import HangConfig

    assert watchdog_config().hang.floor_s == HangConfig.floor_s == 1.5
    assert watchdog_config("alert", 7.5).hang.floor_s == 7.5
    with pytest.raises(ValueError, match="setting 'hang_floor' must be seconds between 0.5 and 180, got 0.1"):
        resolve_settings(build_parser().parse_args(["agent", "--hang-floor", "0.1"]), environ={})
    with pytest.raises(ValueError, match="setting 'straggler_policy' must be one of alert, exclude, got 'kill'"):
        resolve_settings(build_parser().parse_args(["agent"]), environ={"TRAINWARDEN_STRAGGLER_POLICY": "kill"})
    config = tmp_path / "agent.toml"
    config.write_text("hang_floor = 4\n")
    args = build_parser().parse_args(["agent", "--config", str(config)])
    assert resolve_settings(args, environ={})["hang_floor"] == 4
    assert resolve_settings(args, environ={"TRAINWARDEN_HANG_FLOOR": "2.5"})["hang_floor"] == 2.5
    assert resolve_settings(build_parser().parse_args(["agent", "--hang-floor", "9"]), environ={})["hang_floor"] == 9
    config.write_text("hang_floor = \"4s\"\n")
    with pytest.raises(ValueError, match="key 'hang_floor' must be a number"):
        resolve_settings(args, environ={})
    args = build_parser().parse_args(["run", "--hang-floor", "6", "--", "train.py"])
    assert args.hang_floor_s == 6.0
    with pytest.raises(ValueError, match="--hang-floor must be seconds between 0.5 and 180, got 900"):
        RunOptions(script=["train.py"], job="j", hang_floor_s=900)


def test_incidents_list_and_show_are_wired(capsys, tmp_path):
    store = IncidentStore(state_dir=lambda job: job_state_dir(job, tmp_path))
    ts = 1_790_000_000.0
    inc = store.record(Incident(id=new_incident_id(ts), kind=IncidentKind.HANG, job="demo", node="n1", ranks=(3,),
                                detected_at=ts, updated_at=ts, evidence={"stalled_seconds": 4.0}))
    home = ["--state-home", str(tmp_path)]
    assert main(["incidents", *home]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split()[:2] == ["ID", "KIND"] and row.split()[:2] == [inc.id, "hang"]
    assert main(["incidents", "--job", "other", *home]) == 0
    assert capsys.readouterr().out == "no incidents for job other\n"
    assert main(["incidents", "--json", *home, "show", inc.id[:20]]) == 0  # --json before `show` is kept
    assert json.loads(capsys.readouterr().out)["id"] == inc.id
    assert main(["incidents", "show", inc.id, *home]) == 0
    assert "stalled_seconds: 4.0" in capsys.readouterr().out
    assert main(["incidents", "show", "nope", *home]) == exit_codes.EXIT_USAGE
    assert "no incident matching 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:  # the one job-name rule, checked by the parser for every --job
        main(["incidents", "--job", "Not A Job", *home])
    assert bad.value.code == exit_codes.EXIT_USAGE
    assert "is invalid" in capsys.readouterr().err


def test_run_is_still_there(capsys):
    assert main(["run", "--nproc-per-node", "2"]) == exit_codes.EXIT_USAGE
    assert "nothing to run" in capsys.readouterr().err


# ---- deploy/ ------------------------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_unit_is_one_systemd_accepts(tmp_path):
    """systemd's own parser: an unknown or misspelt key, a bad value or a missing section is an error here.
    ExecStart points at where `pip install` puts the command; the copy points at this environment's."""
    import sys

    unit = (DEPLOY / "systemd" / "trainwarden-agent.service").read_text()
    assert "/usr/local/bin/trainwarden " in unit
    copy = tmp_path / "trainwarden-agent.service"
    copy.write_text(unit.replace("/usr/local/bin/trainwarden ", str(Path(sys.executable).parent / "trainwarden") + " "))
    result = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60)
    problems = [line for line in (result.stdout + result.stderr).splitlines() if str(copy) in line or "Unknown" in line]
    assert result.returncode == 0 and not problems, result.stdout + result.stderr


def _unit_settings() -> dict[str, str]:
    unit = (DEPLOY / "systemd" / "trainwarden-agent.service").read_text()
    return dict(line.split("=", 1) for line in unit.replace("\\\n", " ").splitlines() if re.match(r"^[A-Z]\w*=", line))


def test_systemd_unit_runs_the_agent_with_flags_the_cli_accepts():
    """The unit's command line with the example config it names: the socket is in the directory the unit
    creates (RuntimeDirectory=), the state home is its StateDirectory=, and the port is the one scraped."""
    from trainwarden.agent.cli.agent import resolve_settings

    settings = _unit_settings()
    argv = shlex.split(settings["ExecStart"].replace("$TRAINWARDEN_AGENT_ARGS", ""))
    assert Path(argv[0]).name == "trainwarden"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "agent" and args.config == "/etc/trainwarden/agent.toml"
    args.config = str(DEPLOY / "systemd" / "agent.toml")  # what the unit's install step puts there
    agent = resolve_settings(args, environ={})
    assert agent["socket"] == "/run/" + settings["RuntimeDirectory"] + "/agent.sock" == "/run/trainwarden/agent.sock"
    assert agent["state_home"] == "/var/lib/" + settings["StateDirectory"]
    assert agent["metrics_port"] == 9478


def test_systemd_unit_watches_the_agent_and_spares_its_jobs():
    """Type=notify with keep-alives the agent sends itself (agent/node/liveness.py), restarts that leave the
    jobs alone, and no restart for a usage error."""
    settings = _unit_settings()
    assert (settings["Type"], settings["NotifyAccess"], settings["KillMode"]) == ("notify", "main", "process")
    assert settings["WatchdogSec"].endswith("s") and int(settings["WatchdogSec"][:-1]) >= 10
    assert settings["Restart"] == "always"
    assert settings["RestartPreventExitStatus"].split() == [str(exit_codes.EXIT_USAGE)]
    # NVML needs /dev/nvidia*: nothing that closes the device list (ProtectClock= implies DeviceAllow=)
    assert not {"PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock"} & settings.keys()
    assert "CAP_KILL" in settings["CapabilityBoundingSet"].split()


def test_prometheus_example_scrapes_the_agents_default_port():
    """What deploy/prometheus.yml scrapes is the port the agent serves (deploy/kubernetes has its own checks:
    tests/unit/test_deploy_kubernetes.py)."""
    yaml = pytest.importorskip("yaml", reason="PyYAML not installed")
    from trainwarden.agent.cli.agent import resolve_settings

    defaults = resolve_settings(build_parser().parse_args(["agent"]), environ={})
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert config["scrape_configs"][0]["static_configs"][0]["targets"][0].endswith(f":{defaults['metrics_port']}")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_prometheus_example_passes_promtool():
    result = subprocess.run(["promtool", "check", "config", str(DEPLOY / "prometheus.yml")],
                            capture_output=True, text=True, timeout=20)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_printed_line_reaches_an_unbuffered_stdout_in_one_write(tmp_path):
    """Under PYTHONUNBUFFERED (which torchrun users set), print() wrote a line's text and its newline as two
    writes: torchrun's stderr, which shares the terminal or log file, landed between them and split a
    `trainwarden:` line from its end (seen in CI as a run log with a torchrun record glued to one of ours)."""
    script = ("import io, sys\n"
              "class Raw(io.RawIOBase):\n"
              "    writes = []\n"
              "    def writable(self): return True\n"
              "    def write(self, b): Raw.writes.append(bytes(b)); return len(b)\n"
              "sys.stdout = io.TextIOWrapper(Raw(), write_through=True)\n"
              "from trainwarden.agent.cli.main import whole_lines\n"
              "whole_lines(sys.stdout)\n"
              "print('trainwarden: the worker round failed: rank 1 (SIGKILL)')\n"
              "print('a', 'b', sep='-', end='!\\n')\n"
              "sys.stderr.write(repr(Raw.writes))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr == repr([b"trainwarden: the worker round failed: rank 1 (SIGKILL)\n", b"a-b!\n"])

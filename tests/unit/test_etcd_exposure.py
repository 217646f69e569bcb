"""Plain http to an etcd that is not on loopback is refused unless asked for (issue 30, item 4): whoever can reach
such an etcd reads every job's keys and may write jobs/ (code on every node) or a rendezvous. The check is in
``EtcdSecurity.config``, which every command, the daemon and `trainwarden run` build their client settings with."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trainwarden.agent.cli.agent import resolve_settings
from trainwarden.agent.cli.main import build_parser
from trainwarden.agent.etcd.client import EtcdSecurity


@pytest.mark.parametrize("endpoints", ["127.0.0.1:2379", "localhost:2379", "http://[::1]:2379",
                                       "127.0.0.2:2379,127.0.0.3:2379"])
def test_loopback_over_http_is_fine(endpoints):
    assert EtcdSecurity().config(endpoints).endpoints


@pytest.mark.parametrize("endpoints", ["10.0.0.5:2379", "etcd.trainwarden.svc:2379", "127.0.0.1:2379,10.0.0.6:2379",
                                       "http://192.168.1.4:2379"])
def test_anything_else_over_http_is_refused_with_what_to_do(endpoints):
    with pytest.raises(ValueError) as info:
        EtcdSecurity().config(endpoints)
    message = str(info.value)
    assert "over plain http" in message and "--insecure-etcd" in message and "--etcd-ca" in message
    assert "127.0.0.1" not in message.split("over plain http")[0]  # only the exposed endpoints are named
    assert EtcdSecurity(insecure=True).config(endpoints).endpoints  # the operator's explicit choice


def test_tls_is_not_refused(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("not checked here")
    assert EtcdSecurity(ca_cert=str(ca)).config("https://10.0.0.5:2379").secure


def test_the_flag_and_the_variable_say_it_and_the_agent_takes_it_from_its_config(tmp_path):
    assert EtcdSecurity.from_env({"TRAINWARDEN_INSECURE_ETCD": "1"}).insecure
    assert not EtcdSecurity.from_env({}).insecure
    assert not EtcdSecurity.from_env({"TRAINWARDEN_INSECURE_ETCD": "1"}, insecure=False).insecure
    config = tmp_path / "agent.toml"
    config.write_text("insecure_etcd = true\n")
    args = build_parser().parse_args(["agent", "--config", str(config)])
    assert resolve_settings(args, environ={})["insecure_etcd"] is True
    assert resolve_settings(build_parser().parse_args(["agent"]), environ={})["insecure_etcd"] is False


def test_a_command_against_a_remote_plain_etcd_exits_with_the_reason():
    out = subprocess.run([sys.executable, "-m", "trainwarden.agent.cli", "jobs", "--etcd", "10.255.255.1:2379"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "over plain http" in out.stderr and "--insecure-etcd" in out.stderr, out.stderr


def test_the_embedded_etcd_serves_loopback_only(tmp_path):
    from trainwarden.agent.etcd.embedded import EmbeddedEtcd

    with pytest.raises(ValueError, match="serves this machine only"):
        EmbeddedEtcd(host="0.0.0.0", data_dir=tmp_path)
    assert EmbeddedEtcd(data_dir=tmp_path).host == "127.0.0.1"  # what `trainwarden run` starts

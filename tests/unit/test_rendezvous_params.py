"""rdzv-conf parsing of the etcd3 rendezvous backend: what torchrun passes in, what is rejected and why."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from trainwarden.agent.rendezvous.backend import (
    DEFAULT_KEY_PREFIX,
    Etcd3RendezvousBackend,
    Etcd3RendezvousConfig,
    create_rdzv_handler,
)
from trainwarden.agent.rendezvous import handler_factory


def params(endpoint: str = "10.0.0.1:2379", run_id: str = "job", **conf) -> RendezvousParameters:
    return RendezvousParameters(backend="etcd3", endpoint=endpoint, run_id=run_id, min_nodes=1, max_nodes=2, **conf)


def config(endpoint: str = "10.0.0.1:2379", **conf) -> Etcd3RendezvousConfig:
    return Etcd3RendezvousConfig.from_params(params(endpoint, **conf))


@pytest.mark.timeout(30)
def test_defaults():
    c = config(timeout=900)  # torchrun always adds "timeout"
    assert (c.host, c.port, c.protocol) == ("10.0.0.1", 2379, "http")
    assert c.key_prefix == DEFAULT_KEY_PREFIX == "/trainwarden/v1"
    assert c.read_timeout == 60.0 and c.connect_timeout == 2.0
    assert c.netloc == "10.0.0.1:2379"


@pytest.mark.timeout(30)
def test_entry_point_factory_returns_a_creator():
    assert callable(handler_factory())


@pytest.mark.timeout(30)
def test_port_defaults_to_2379_and_scheme_sets_protocol(tmp_path):
    assert config("etcd.example").port == 2379
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    c = config("https://etcd.example:2380/", ca_cert=str(ca))
    assert (c.host, c.port, c.protocol) == ("etcd.example", 2380, "https")


@pytest.mark.timeout(30)
def test_ipv6_netloc_is_bracketed():
    assert config("[::1]:2379").netloc == "[::1]:2379"


@pytest.mark.timeout(30)
def test_options_and_aliases(tmp_path):
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    key.write_text("k")
    cert.write_text("c")
    secret = tmp_path / "pw"
    secret.write_text("secret\n")
    c = config(key_prefix="/tw", read_timeout="2.5", ssl_cert_key=str(key), ssl_cert=str(cert),
               user="u", password_file=str(secret), join_timeout="30", keep_alive_interval=1)
    assert c.password == "secret"
    assert (c.key_prefix, c.read_timeout, c.protocol) == ("/tw", 2.5, "https")  # https implied by certs
    assert (c.cert_key, c.cert_cert, c.user) == (str(key), str(cert), "u")
    assert "secret" not in repr(c)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"is_host": "1"}, "unknown rdzv-conf option.*is_host.*known: "),
        ({"protocol": "grpc"}, "protocol='grpc' must be http or https"),
        ({"read_timeout": "soon"}, "read_timeout='soon' must be a number"),
        ({"read_timeout": "0"}, "read_timeout=0.0 must be a positive"),
        ({"join_timeout": "abc"}, "join_timeout='abc' must be a positive integer"),
        ({"last_call_timeout": "-1"}, "last_call_timeout='-1' must be a positive integer"),
        ({"key_prefix": "relative"}, "key_prefix='relative' must start with '/'"),
        ({"key_prefix": "/trailing/"}, "must start with '/' and not end with one"),
        ({"ca_cert": "/nonexistent/ca.pem"}, r"ca_cert='/nonexistent/ca.pem': no such file"),
        ({"user": "u"}, "user='u' needs password_file=PATH"),
        ({"password": "p"}, "password=... would put the etcd password on torchrun's command line"),
        ({"user": "u", "password_file": "/nonexistent/pw"}, "password_file='/nonexistent/pw': cannot read it"),
        ({"password_file": "/etc/hostname"}, "password_file given without user"),
        ({"cert_key": "a", "ssl_cert_key": "b"}, "ssl_cert_key and cert_key name the same option"),
    ],
)
def test_invalid_options_raise_value_error(conf, message):
    with pytest.raises(ValueError, match=message):
        config(**conf)


@pytest.mark.timeout(30)
def test_tls_files_with_plain_http_are_rejected(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    with pytest.raises(ValueError, match="ca_cert given with protocol=http"):
        config(ca_cert=str(ca), protocol="http")


@pytest.mark.timeout(30)
def test_client_key_without_certificate_is_rejected(tmp_path):
    key = tmp_path / "k.pem"
    key.write_text("k")
    with pytest.raises(ValueError, match="cert_key and cert_cert .* give both"):
        config(cert_key=str(key))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("endpoint", ["", "   ", "http://"])
def test_missing_endpoint_is_rejected(endpoint):
    with pytest.raises(ValueError, match="--rdzv-endpoint"):
        config(endpoint)


@pytest.mark.timeout(30)
def test_bad_port_is_rejected():
    with pytest.raises(ValueError, match="port"):
        config("host:99999")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("run_id", ["", "a/b", " padded ", "MyJob", "x" * 64])
def test_bad_run_id_is_rejected_before_connecting(run_id):
    with pytest.raises(ValueError, match="--rdzv-id"):
        create_rdzv_handler(params(run_id=run_id))
    with pytest.raises(ValueError, match="--rdzv-id"):
        Etcd3RendezvousBackend(client=None, run_id=run_id)


@pytest.mark.timeout(30)
def test_an_unknown_round_kind_is_rejected_before_connecting():
    with pytest.raises(ValueError, match="round='fast': expected dynamic .* or native"):
        create_rdzv_handler(params(round="fast"))  # 10.0.0.1 is never dialled: the option fails first


@pytest.mark.timeout(30)
def test_password_from_a_file_named_in_the_environment_never_the_environment_itself(tmp_path):
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    p = params(user="u")
    c = Etcd3RendezvousConfig.from_params(p, environ={"TRAINWARDEN_ETCD_PASSWORD_FILE": str(secret)})
    assert (c.user, c.password) == ("u", "from-file")
    with pytest.raises(ValueError, match="needs password_file"):
        Etcd3RendezvousConfig.from_params(p, environ={"TRAINWARDEN_ETCD_PASSWORD": "x"})


@pytest.mark.timeout(30)
def test_several_members_in_the_endpoint():
    c = config("10.0.0.1:2379, 10.0.0.2:2379,[::1]:2380")
    assert (c.host, c.port, c.other_members) == ("10.0.0.1", 2379, ("10.0.0.2:2379", "[::1]:2380"))
    assert c.etcd.netlocs == ["10.0.0.1:2379", "10.0.0.2:2379", "[::1]:2380"]
    assert config("10.0.0.1:2379").other_members == ()


@pytest.mark.timeout(30)
def test_an_etcd_outage_between_rounds_does_not_end_the_agent(caplog):
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    from trainwarden.agent.rendezvous.backend import keep_training_through_etcd_outages

    answers = [2, RendezvousConnectionError("quorum lost"), RendezvousConnectionError("quorum lost"), 1]

    class Handler:
        def num_nodes_waiting(self):
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

    handler = Handler()
    keep_training_through_etcd_outages(handler, clock=iter([10.0, 25.0]).__next__)
    assert [handler.num_nodes_waiting() for _ in range(4)] == [2, 0, 0, 1]
    said = [r.getMessage() for r in caplog.records]
    assert sum("the running round trains on" in m for m in said) == 1  # once per outage, not per poll
    assert any("again after 15 s" in m for m in said)

"""The agent's health check on TCP (agent/telemetry/health_endpoint.py): it answers what the telemetry server's
health service says, serves nothing else, and a port it cannot bind is one clear error."""

from __future__ import annotations

import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trainwarden.agent.node.agent import AgentConfig, NodeAgent
from trainwarden.agent.shared.contract import SERVICE_NAME, STATUS_METHOD
from trainwarden.agent.telemetry import HealthEndpoint, HealthEndpointError, JobTelemetry, TelemetryServer

pytestmark = pytest.mark.timeout(30)

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def check(port: int, service: str = "") -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return reply.status


@pytest.fixture
def telemetry(tmp_path):
    server = TelemetryServer(tmp_path / "a.sock", JobTelemetry())
    server.start()
    yield server
    server.stop(0)


def test_answers_from_the_telemetry_servers_health_and_says_not_serving_once_it_stops(telemetry):
    endpoint = HealthEndpoint("127.0.0.1", 0).start(telemetry.health)
    try:
        assert endpoint.port > 0 and endpoint.address == f"127.0.0.1:{endpoint.port}"
        assert check(endpoint.port) == SERVING and check(endpoint.port, SERVICE_NAME) == SERVING
        telemetry.stop(0)
        assert check(endpoint.port) == NOT_SERVING
    finally:
        endpoint.stop()
    with pytest.raises(grpc.RpcError) as refused:
        check(endpoint.port)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_serves_check_only_not_watch_nor_the_telemetry_services(telemetry):
    endpoint = HealthEndpoint("127.0.0.1", 0).start(telemetry.health)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{endpoint.port}") as channel:
            with pytest.raises(grpc.RpcError) as watch:  # a Watch would hold a server thread for good
                next(health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=5))
            assert watch.value.code() == grpc.StatusCode.UNIMPLEMENTED
            status = channel.unary_unary(STATUS_METHOD, request_serializer=lambda m: b"",
                                         response_deserializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as telemetry_call:
                status(b"", timeout=5)
            assert telemetry_call.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        endpoint.stop()


def test_a_taken_port_is_one_clear_error(telemetry):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(HealthEndpointError, match=rf"cannot serve the health check on 127\.0\.0\.1:{port}: "
                                                      r"Address already in use; another process holds it"):
            HealthEndpoint("127.0.0.1", port).start(telemetry.health)
    with pytest.raises(HealthEndpointError, match="not an address of this host"):
        HealthEndpoint("192.0.2.1", 0).start(telemetry.health)  # TEST-NET-1: never local
    with pytest.raises(ValueError, match="health port 70000 is not a TCP port"):
        HealthEndpoint("127.0.0.1", 70000)


def test_node_agent_serves_it_only_when_asked_and_not_serving_while_it_stops(tmp_path):
    quiet = dict(metrics_port=None, gpu_health=False)
    without = NodeAgent(AgentConfig(socket_path=tmp_path / "a.sock", **quiet))
    assert without.health_endpoint is None and without.health_url is None

    agent = NodeAgent(AgentConfig(socket_path=tmp_path / "b.sock", health_port=0, **quiet)).start()
    try:
        port = agent.health_endpoint.port
        assert agent.health_url == f"grpc://127.0.0.1:{port}" and check(port) == SERVING
        seen = []
        agent._stops.append(lambda: seen.append(check(port)))  # the first step of the agent's stop
    finally:
        agent.stop()
    assert seen == [NOT_SERVING]

from trainwarden.agent.common.netaddr import interface_of, route_address


def test_loopback_routes_through_lo():
    assert route_address("127.0.0.1") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.123") is None  # TEST-NET-1: on no interface here

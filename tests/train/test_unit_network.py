"""Which interface a unit's gloo group binds to (train/hardware/unit_network.py): the route to the master, never
loopback for a remote master, and the user's GLOO_SOCKET_IFNAME wins. The unit across hosts that needs it runs in
tests/peer/test_multihost_unit.py (network namespaces)."""

from __future__ import annotations

import os
import socket

import pytest

from p2p_diloco.train.hardware.unit_network import _ipv4_of, pick_gloo_interface, route_interface


def _non_loopback() -> tuple[str, str]:
    for _, name in socket.if_nameindex():
        address = _ipv4_of(name)
        if address and not address.startswith("127."):
            return name, address
    pytest.skip("no interface with a non-loopback IPv4 address here")


def test_a_master_on_this_host_by_loopback_changes_nothing(monkeypatch):
    assert route_interface("127.0.0.1") is None
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    pick_gloo_interface()
    assert "GLOO_SOCKET_IFNAME" not in os.environ


def test_the_interface_that_routes_to_the_master_is_picked_unless_one_is_given(monkeypatch):
    name, address = _non_loopback()
    assert route_interface(address) == name  # the master is reached from this interface's own address
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("MASTER_ADDR", address)
    pick_gloo_interface()
    assert os.environ["GLOO_SOCKET_IFNAME"] == name
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine0")
    pick_gloo_interface()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "mine0"

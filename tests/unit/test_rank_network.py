"""A multi-node rank binds gloo to the interface of its host's address (backend/rank_network.py),
read from this machine's real interfaces as `ip` lists them."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

import pytest

from dynamo_graph.backend.rank_network import IFNAME_ENV, bind_gloo_to_host_address, interface_holding


def _ip_addresses() -> dict[str, str]:
    """IPv4 address -> interface, as `ip -o -4 addr show` reports them (primary addresses)."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command")
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True)
    found: dict[str, str] = {}
    for line in out.stdout.splitlines():
        words = line.split()
        if "secondary" not in words:
            found.setdefault(words[3].split("/")[0], words[1].split("@")[0])
    return found


def _bind(monkeypatch: pytest.MonkeyPatch, address: str | None, preset: str | None = None) -> str | None:
    """GLOO_SOCKET_IFNAME after a rank with DYN_TCP_HOST=address (None: unset) starts."""
    for name, value in (("DYN_TCP_HOST", address), (IFNAME_ENV, preset)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    bind_gloo_to_host_address()
    return os.environ.get(IFNAME_ENV)


def test_interface_holding_names_each_interface_of_its_address_and_none_for_others() -> None:
    addresses = _ip_addresses()
    assert addresses.get("127.0.0.1") == "lo"
    for address, name in addresses.items():
        assert interface_holding(address) == name
    assert interface_holding("203.0.113.77") is None  # TEST-NET-3: on no interface here


def test_a_rank_given_its_host_address_binds_gloo_to_that_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    routable = [(a, name) for a, name in _ip_addresses().items() if not a.startswith("127.")]
    if not routable:
        pytest.skip("no interface with a routable IPv4 address here")
    address, name = routable[0]
    assert _bind(monkeypatch, address) == name
    assert _bind(monkeypatch, address, preset="eth9") == "eth9"  # the graph's own setting wins


def test_a_rank_without_a_routable_held_address_leaves_gloo_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert _bind(monkeypatch, None) is None  # a graph on one host
    assert _bind(monkeypatch, "127.0.0.1") is None
    with caplog.at_level(logging.WARNING):
        assert _bind(monkeypatch, "203.0.113.77") is None
    assert "no interface holds DYN_TCP_HOST=203.0.113.77" in caplog.text
    assert "set GLOO_SOCKET_IFNAME" in caplog.text

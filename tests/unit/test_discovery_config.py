"""create_discovery: arguments win over the environment, bad values name the setting."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dynamo_graph.runtime.discovery import DiscoveryError, create_discovery
from dynamo_graph.runtime.discovery.etcd import EtcdDiscovery, parse_endpoint
from dynamo_graph.runtime.discovery.file import FileDiscovery

ENV = ("DYN_DISCOVERY_BACKEND", "DYN_FILE_KV", "ETCD_ENDPOINTS", "DYN_LEASE_TTL")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def test_defaults_are_file_in_per_user_temp_dir() -> None:
    d = create_discovery()
    assert isinstance(d, FileDiscovery)
    assert d.backend == "file"
    assert d.root.name == f"dyngraph_store_kv-{os.getuid()}"
    assert d.ttl_s == 10.0


def test_env_file_root_and_ttl(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DYN_DISCOVERY_BACKEND", " File ")
    monkeypatch.setenv("DYN_FILE_KV", str(tmp_path))
    monkeypatch.setenv("DYN_LEASE_TTL", "2.5")
    d = create_discovery()
    assert isinstance(d, FileDiscovery)
    assert (d.root, d.ttl_s) == (tmp_path, 2.5)


def test_arguments_win_over_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DYN_DISCOVERY_BACKEND", "etcd")
    monkeypatch.setenv("DYN_FILE_KV", "/nonexistent")
    monkeypatch.setenv("DYN_LEASE_TTL", "30")
    d = create_discovery("file", file_root=str(tmp_path), ttl_s=3)
    assert isinstance(d, FileDiscovery)
    assert (d.root, d.ttl_s) == (tmp_path, 3.0)


def test_etcd_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_DISCOVERY_BACKEND", "etcd")
    monkeypatch.setenv("ETCD_ENDPOINTS", "http://10.0.0.1:2379, 10.0.0.2:2380,")
    monkeypatch.setenv("DYN_LEASE_TTL", "2.5")
    d = create_discovery()
    assert isinstance(d, EtcdDiscovery)
    assert d.backend == "etcd"
    assert d._endpoints == [("10.0.0.1", 2379), ("10.0.0.2", 2380)]
    assert d._ttl_s == 3  # etcd TTLs are whole seconds: rounded up


def test_etcd_default_endpoint_and_list_argument() -> None:
    assert create_discovery("etcd")._endpoints == [("127.0.0.1", 2379)]  # type: ignore[attr-defined]
    d = create_discovery("etcd", etcd_endpoints=["localhost:1234"])
    assert d._endpoints == [("localhost", 1234)]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("env", "value", "match"),
    [
        ("DYN_DISCOVERY_BACKEND", "consul", r"DYN_DISCOVERY_BACKEND='consul': expected one of file, etcd"),
        ("DYN_LEASE_TTL", "ten", r"DYN_LEASE_TTL='ten': expected a number of seconds > 0"),
        ("DYN_LEASE_TTL", "0", r"DYN_LEASE_TTL=0\.0: expected a number of seconds > 0"),
        ("DYN_LEASE_TTL", "nan", r"DYN_LEASE_TTL=nan"),
    ],
)
def test_bad_env_values(monkeypatch: pytest.MonkeyPatch, env: str, value: str, match: str) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(DiscoveryError, match=match):
        create_discovery()


def test_bad_etcd_endpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ETCD_ENDPOINTS", "ftp://secure:2379")
    with pytest.raises(DiscoveryError, match=r"ETCD_ENDPOINTS: .*expected http\(s\)://host:port"):
        create_discovery("etcd")
    monkeypatch.setenv("ETCD_ENDPOINTS", " , ")
    with pytest.raises(DiscoveryError, match=r"ETCD_ENDPOINTS=' , ': expected http://host:port"):
        create_discovery("etcd")
    with pytest.raises(DiscoveryError, match=r"etcd endpoints: .*bad port"):
        create_discovery("etcd", etcd_endpoints="127.0.0.1:notaport")


def test_bad_arguments_name_the_flag() -> None:
    with pytest.raises(DiscoveryError, match=r"--discovery-backend='mem': expected one of file, etcd"):
        create_discovery("mem")
    with pytest.raises(DiscoveryError, match=r"lease TTL=-1"):
        create_discovery("file", ttl_s=-1)
    with pytest.raises(DiscoveryError, match=r"etcd leases need at least 1 s"):
        create_discovery("etcd", ttl_s=0.5)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("http://127.0.0.1:2379", ("127.0.0.1", 2379)),
        ("127.0.0.1:2379", ("127.0.0.1", 2379)),
        ("etcd.svc", ("etcd.svc", 2379)),
        ("http://[::1]:2379/", ("::1", 2379)),
    ],
)
def test_parse_endpoint(text: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(text) == expected

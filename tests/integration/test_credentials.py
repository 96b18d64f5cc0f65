"""Credentials from the environment: etcd user/password against a real etcd with auth on, and
the checks on the NATS / etcd TLS variables."""

from __future__ import annotations

from pathlib import Path

import pytest
from etcd3aio import Etcd3Client

from dynamo_graph.runtime.credentials import CredentialsError, etcd_credentials, nats_connect_options
from dynamo_graph.runtime.discovery import DiscoveryError
from dynamo_graph.runtime.discovery.etcd import EtcdDiscovery
from tests.support.services import EtcdProc

PASSWORD = "s3cret-pw"


async def _enable_auth(etcd: EtcdProc) -> None:
    """etcd with a root user and authentication on (root may do everything)."""
    admin = Etcd3Client([etcd.url.removeprefix("http://")])
    await admin.connect()
    try:
        await admin.auth.user_add("root", PASSWORD)
        await admin.auth.role_add("root")
        await admin.auth.user_grant_role("root", "root")
        await admin.auth.auth_enable()
    finally:
        await admin.close()


async def test_etcd_discovery_authenticates_from_the_environment(
    etcd_fresh: EtcdProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _enable_auth(etcd_fresh)
    anonymous = EtcdDiscovery([etcd_fresh.url], ttl_s=2)
    await anonymous.start()  # etcd grants leases to anyone
    try:
        with pytest.raises(DiscoveryError):
            await anonymous.put("v1/test/key", b'{"a": 1}')  # but writing needs a user now
    finally:
        await anonymous.close()

    monkeypatch.setenv("ETCD_AUTH_USERNAME", "root")
    monkeypatch.setenv("ETCD_AUTH_PASSWORD", "wrong")
    with pytest.raises(DiscoveryError, match="authentication as 'root' failed") as info:
        await EtcdDiscovery([etcd_fresh.url], ttl_s=2).start()
    assert "wrong" not in str(info.value)

    monkeypatch.setenv("ETCD_AUTH_PASSWORD", PASSWORD)
    discovery = EtcdDiscovery([etcd_fresh.url], ttl_s=2)
    await discovery.start()
    try:
        await discovery.put("v1/test/key", b'{"a": 1}')
        assert await discovery.get_prefix("v1/test/") == {"v1/test/key": b'{"a": 1}'}
    finally:
        await discovery.close()
    assert PASSWORD not in repr(etcd_credentials())


def test_credential_variables_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ETCD_AUTH_USERNAME", "root")
    with pytest.raises(CredentialsError, match="go together"):
        etcd_credentials()
    monkeypatch.delenv("ETCD_AUTH_USERNAME")
    monkeypatch.setenv("ETCD_AUTH_CLIENT_CERT", str(tmp_path / "missing.pem"))
    with pytest.raises(CredentialsError, match="no such file"):
        etcd_credentials()
    monkeypatch.delenv("ETCD_AUTH_CLIENT_CERT")
    creds = tmp_path / "user.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\n")
    monkeypatch.setenv("NATS_CREDS", str(creds))
    assert nats_connect_options() == {"user_credentials": str(creds)}
    monkeypatch.setenv("NATS_TLS_CERT", str(creds))
    with pytest.raises(CredentialsError, match="NATS_TLS_CERT and NATS_TLS_KEY"):
        nats_connect_options()


async def test_https_etcd_needs_a_ca(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ETCD_AUTH_CA", raising=False)
    with pytest.raises(DiscoveryError, match="ETCD_AUTH_CA"):
        await EtcdDiscovery(["https://127.0.0.1:1"], ttl_s=2).start()

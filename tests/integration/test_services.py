"""The service fixtures themselves: nats-server and etcd start, restart on the same port, and die."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.support.services import EtcdProc, NatsProc, start_nats


def _connects(url: str) -> bool:
    host, port = url.rsplit("//", 1)[-1].rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def test_nats_restart_keeps_the_port(nats_server: NatsProc, tmp_path: Path) -> None:
    assert nats_server.url.startswith("nats://127.0.0.1:") and _connects(nats_server.url)
    proc = start_nats(tmp_path, jetstream=True)
    url = proc.url
    proc.restart()
    assert proc.url == url and _connects(url)
    proc.kill()
    assert not proc.running and not _connects(url)


def test_etcd_fresh_restart_and_kill(etcd_fresh: EtcdProc) -> None:
    assert _connects(etcd_fresh.url)
    etcd_fresh.restart()
    assert etcd_fresh.running and _connects(etcd_fresh.url)
    etcd_fresh.kill()
    assert not etcd_fresh.running and not _connects(etcd_fresh.url)

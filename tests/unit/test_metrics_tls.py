"""`/metrics` over TLS (runtime/metrics_http.py): the scraper's certificate (of its own CA) gets the
series, a client without one or with a member's gets nothing, the graph's other listeners (which
trust the graph's CA) refuse the scraper, and the same files given again are reloaded (the
supervisor's server outlives the revision that issued its certificate)."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from prometheus_client import Gauge
from prometheus_client.registry import CollectorRegistry

from dynamo_graph.graph.tls import METRICS_NAME, SCRAPE_CA, ca_file, cert_files, issue_all
from dynamo_graph.runtime.metrics_http import MetricsServer
from dynamo_graph.runtime.tls import TlsFiles


async def _get(port: int, context: ssl.SSLContext) -> tuple[bytes, int | None]:
    """The answer to `GET /metrics` and the serial of the certificate the server showed."""

    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname=METRICS_NAME
    )
    shown = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    try:
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        answer = await reader.read()
    except (ConnectionError, ssl.SSLError):
        answer = b""
    finally:
        writer.close()
    return answer, x509.load_der_x509_certificate(shown).serial_number if shown else None


def _client(folder: Path, process: str | None) -> ssl.SSLContext:
    """A client trusting the graph's CA (the servers' certificates), showing `process`'s."""
    context = ssl.create_default_context(cafile=ca_file(folder))
    if process is not None:
        context.load_cert_chain(*cert_files(folder, process))
    return context


async def test_metrics_answer_the_scraper_alone_and_only_metrics_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = {"w-0": ["127.0.0.1", METRICS_NAME], "w-1": [], "scraper": []}
    issue_all(tmp_path, "g", names)
    monkeypatch.setenv("DYN_TLS_CA_FILE", ca_file(tmp_path))
    monkeypatch.setenv("DYN_TLS_CERT_FILE", cert_files(tmp_path, "w-0")[0])
    monkeypatch.setenv("DYN_TLS_KEY_FILE", cert_files(tmp_path, "w-0")[1])
    monkeypatch.setenv("DYN_TLS_METRICS_CA_FILE", ca_file(tmp_path, SCRAPE_CA))
    files = TlsFiles.for_metrics()
    assert files == TlsFiles(ca_file(tmp_path, SCRAPE_CA), *cert_files(tmp_path, "w-0"))
    registry = CollectorRegistry()
    Gauge("dyngraph_test_value", "a value", registry=registry).set(7)
    metrics, plane = MetricsServer(registry), MetricsServer(registry)
    await metrics.follow(("127.0.0.1", 0), files)
    await plane.follow(("127.0.0.1", 0), TlsFiles.from_env())  # as every other listener trusts
    assert metrics.port and plane.port and metrics.scheme == "https"
    try:
        answer, first = await _get(metrics.port, _client(tmp_path, "scraper"))
        assert answer.startswith(b"HTTP/1.1 200") and b"dyngraph_test_value 7.0" in answer
        assert (await _get(metrics.port, _client(tmp_path, None)))[0] == b""
        assert (await _get(metrics.port, _client(tmp_path, "w-1")))[0] == b""  # a member: not a scraper
        assert (await _get(plane.port, _client(tmp_path, "scraper")))[0] == b""  # nor the scraper a member
        assert (await _get(plane.port, _client(tmp_path, "w-1")))[0].startswith(b"HTTP/1.1 200")
        issue_all(tmp_path, "g", names)  # a new revision: new certificates, the same files
        await metrics.follow(("127.0.0.1", 0), files)  # as before: the same server, reloaded
        again, second = await _get(metrics.port, _client(tmp_path, "scraper"))
        assert again.startswith(b"HTTP/1.1 200") and second != first
    finally:
        await metrics.close()
        await plane.close()

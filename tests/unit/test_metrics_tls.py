"""`/metrics` over the graph's mutual TLS (runtime/metrics_http.py): the scraper's certificate gets
the series, a client without one gets nothing, and the same files given again are reloaded (the
supervisor's server outlives the revision that issued its certificate)."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

from cryptography import x509
from prometheus_client import Gauge
from prometheus_client.registry import CollectorRegistry

from dynamo_graph.graph.tls import METRICS_NAME, ca_file, cert_files, issue_all
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


async def test_the_scraper_reads_metrics_and_a_client_without_a_certificate_does_not(tmp_path: Path) -> None:
    names = {"w-0": ["127.0.0.1", METRICS_NAME], "scraper": []}
    issue_all(tmp_path, "g", names)
    registry = CollectorRegistry()
    Gauge("dyngraph_test_value", "a value", registry=registry).set(7)
    server = MetricsServer(registry)
    files = TlsFiles(ca_file(tmp_path), *cert_files(tmp_path, "w-0"))
    await server.follow(("127.0.0.1", 0), files)
    assert server.port and server.scheme == "https"
    scraper = ssl.create_default_context(cafile=ca_file(tmp_path))
    scraper.load_cert_chain(*cert_files(tmp_path, "scraper"))
    stranger = ssl.create_default_context(cafile=ca_file(tmp_path))  # trusts the CA, shows nothing
    try:
        answer, first = await _get(server.port, scraper)
        assert answer.startswith(b"HTTP/1.1 200") and b"dyngraph_test_value 7.0" in answer
        refused, _ = await _get(server.port, stranger)
        assert refused == b""
        issue_all(tmp_path, "g", names)  # a new revision: new certificates, the same files
        await server.follow(("127.0.0.1", 0), files)  # as before: the same server, reloaded
        again, second = await _get(server.port, scraper)
        assert again.startswith(b"HTTP/1.1 200") and second != first
    finally:
        await server.close()

"""The planes with a graph's TLS files: the tcp request plane is mutual TLS 1.3 against the
graph's CA (a caller or server without a certificate of it gets nothing served), and the zmq
event plane speaks CURVE with the graph's key (a subscriber without it reads nothing); the
frontend serves HTTPS with the files it is given.

Real sockets and real certificates (graph/tls.py); discovery for zmq is the file backend."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import zmq
import zmq.asyncio
from openai import OpenAI

from dynamo_graph.graph.tls import ca_file, cert_files, curve_file, issue_all
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.discovery.file import FileDiscovery
from dynamo_graph.runtime.events.curve import ENV as CURVE_ENV
from dynamo_graph.runtime.events.curve import CurveKeys
from dynamo_graph.runtime.events.zmq import ZmqEventPublisher, ZmqEventSubscriber
from dynamo_graph.runtime.tls import ENV_CA, ENV_CERT, ENV_KEY, TlsFiles
from dynamo_graph.runtime.transport import CannotConnect, StreamBroken, create_client, create_server
from dynamo_graph.runtime.transport.frames import HEADER, Request, encode
from dynamo_graph.runtime.transport.tcp import TcpRequestPlaneClient, TcpRequestPlaneServer, parse_address
from tests.support.processes import ServerProcess, echo_core_args
from tests.support.waiting import wait_for

SUBJECT = "g.w.generate-1"


def _files(folder: Path, process: str) -> TlsFiles:
    cert, key = cert_files(folder, process)
    return TlsFiles(ca_file(folder), cert, key)


@pytest.fixture(scope="module")
def graphs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two graphs' CAs: `a` (the one under test) and `b` (another graph on the same network)."""
    a, b = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    issue_all(a, "a", {"worker": [], "frontend": []})
    issue_all(b, "b", {"intruder": []})
    return a, b


class Served:
    def __init__(self) -> None:
        self.requests: list[bytes] = []

    async def handler(self, body: bytes, headers: dict[str, str], context: Context) -> AsyncIterator[bytes]:
        self.requests.append(body)
        for i in range(3):
            yield body + b":" + str(i).encode()


async def _collect(client: TcpRequestPlaneClient, record: dict[str, str], body: bytes) -> list[bytes]:
    return [chunk async for chunk in client.stream(record, SUBJECT, body, {}, Context(), timeout_s=3.0)]


async def test_request_plane_is_mutual_tls_within_the_graph(
    graphs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = graphs
    # The settings as a process gets them (env), through the transport's factory.
    for name, value in zip((ENV_CA, ENV_CERT, ENV_KEY), (ca_file(a), *cert_files(a, "worker")), strict=True):
        monkeypatch.setenv(name, value)
    served = Served()
    server = create_server("tcp", host="127.0.0.1", port=0)
    assert isinstance(server, TcpRequestPlaneServer) and server.ssl is not None
    await server.start()
    record = server.register(SUBJECT, served.handler)
    member = create_client("tcp")
    assert isinstance(member, TcpRequestPlaneClient)
    outsiders = {
        "plain tcp": TcpRequestPlaneClient(),
        "tls without a certificate": TcpRequestPlaneClient(ssl=_no_cert_context(a)),
        "another graph's certificate": TcpRequestPlaneClient(ssl=_files(b, "intruder").client_context()),
    }
    try:
        async with asyncio.timeout(20):
            assert await _collect(member, record, b"hi") == [b"hi:0", b"hi:1", b"hi:2"]
            for why, client in outsiders.items():
                with pytest.raises((CannotConnect, StreamBroken)):
                    await _collect(client, record, why.encode())
            assert served.requests == [b"hi"], "an outsider's request reached the handler"
            # A server outside the graph does not get the graph's callers either.
            fake = TcpRequestPlaneServer(ssl=_files(b, "intruder").server_context())
            await fake.start()
            fake_record = fake.register(SUBJECT, served.handler)
            with pytest.raises(CannotConnect):
                await _collect(member, fake_record, b"secret prompt")
            await fake.stop()
            assert served.requests == [b"hi"]
            # A raw socket speaking the plane's frames in the clear gets the connection closed.
            assert await _raw_request(record["tcp"]) == b""
    finally:
        for client in [member, *outsiders.values()]:
            await client.close()
        await server.stop()


def _no_cert_context(folder: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(ca_file(folder))
    return ctx


def raw_request_frame(subject: str, body: bytes) -> bytes:
    """A well-formed request frame of the tcp plane, as a client in the clear would send it."""
    payload = encode(Request(1, subject, {}, body, "r-1"))
    return HEADER.pack(len(payload)) + payload


async def _raw_request(address: str) -> bytes:
    """What a worker port answers a request frame sent in plain TCP (b"": it closed)."""
    host, port = parse_address(address)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(raw_request_frame(SUBJECT, b"plain"))
        await writer.drain()
        return await asyncio.wait_for(reader.read(4096), 5)
    except OSError:
        return b""
    finally:
        writer.close()


# ---- zmq event plane: CURVE ----------------------------------------------------------------------


async def test_zmq_events_reach_only_holders_of_the_graph_key(
    graphs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = graphs
    discovery = FileDiscovery(tmp_path / "discovery", ttl_s=2.0, poll_s=0.05)
    await discovery.start()
    monkeypatch.setenv(CURVE_ENV, curve_file(a))
    pub = await ZmqEventPublisher.create(discovery, "g", "w", 0x51)
    member = await ZmqEventSubscriber.create(discovery, "g", "w", ["kv"])
    monkeypatch.setenv(CURVE_ENV, curve_file(b))  # another graph's key
    stranger = await ZmqEventSubscriber.create(discovery, "g", "w", ["kv"])
    monkeypatch.delenv(CURVE_ENV)  # none: plain zmq
    plain = await ZmqEventSubscriber.create(discovery, "g", "w", ["kv"])
    try:
        async with asyncio.timeout(20):
            got = await _first_event(pub, member, b"blocks", 5.0)
            assert got == b"blocks"
            for outsider in (stranger, plain):
                assert await _first_event(pub, outsider, b"leak", 1.0) is None
            # One that knows the graph's public key (the publisher's) but holds its own key pair:
            # the publisher's ZAP handler turns it away.
            [endpoint] = member.publishers.values()
            assert (
                await _raw_curve_subscriber(pub, endpoint, CurveKeys.from_file(curve_file(a)).public) is None
            )
    finally:
        for sub in (member, stranger, plain):
            await sub.close()
        await pub.close()
        await discovery.close()


async def _raw_curve_subscriber(pub: ZmqEventPublisher, endpoint: str, server_key: bytes) -> bytes | None:
    context = zmq.asyncio.Context.instance()
    sock = context.socket(zmq.SUB)
    public, secret = zmq.curve_keypair()
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_key, public, secret
    sock.setsockopt(zmq.SUBSCRIBE, b"kv")
    sock.connect(endpoint)
    try:
        loop = asyncio.get_running_loop()
        until = loop.time() + 1.0
        while loop.time() < until:
            await pub.publish("kv", b"leak")
            if await sock.poll(50):
                return (await sock.recv_multipart())[-1]
        return None
    finally:
        sock.close(linger=0)


async def _first_event(
    pub: ZmqEventPublisher, sub: ZmqEventSubscriber, payload: bytes, within_s: float
) -> bytes | None:
    """Publish `payload` repeatedly (zmq drops what is sent before a connection is up) until `sub`
    reads one, or `within_s` passes."""
    events = sub.events()
    reading = asyncio.ensure_future(anext(events))
    try:
        loop = asyncio.get_running_loop()
        until = loop.time() + within_s
        while loop.time() < until:
            await pub.publish("kv", payload)
            done, _ = await asyncio.wait([reading], timeout=0.05)
            if done:
                return reading.result().payload
        return None
    finally:
        reading.cancel()
        with contextlib.suppress(BaseException):
            await reading


# ---- the frontend over HTTPS ---------------------------------------------------------------------


def test_frontend_serves_https_to_the_official_client(tmp_path: Path, tiny_model: Path) -> None:
    """`--http-tls-cert-file` / `--http-tls-key-file` (a graph frontend's `http.tls`): the
    official client gets its answer over HTTPS, trusting only the certificate's CA."""
    issue_all(tmp_path / "tls", "web", {"api": []})
    cert, key = cert_files(tmp_path / "tls", "api")
    args = echo_core_args(tiny_model, "tiny", "--http-tls-cert-file", cert, "--http-tls-key-file", key)
    server = ServerProcess(args, log_dir=tmp_path)
    try:
        url = f"https://127.0.0.1:{server.port}"
        with httpx.Client(verify=ssl.create_default_context(cafile=ca_file(tmp_path / "tls"))) as http:
            wait_for(lambda: _ok(http, f"{url}/health"), 30, "the HTTPS frontend")
            client = OpenAI(base_url=f"{url}/v1", api_key="none", http_client=http, max_retries=0)
            reply = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4
            )
            assert reply.choices[0].message.content
        with pytest.raises(httpx.TransportError):  # plain HTTP on the HTTPS port gets no answer
            httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=3).raise_for_status()
    finally:
        assert server.stop() == 0, server.log()


def _ok(http: httpx.Client, url: str) -> bool:
    try:
        return http.get(url, timeout=1).status_code == 200
    except httpx.TransportError:
        return False

"""The frontend's parts of a rolling update that need no processes: sockets that share a port,
the probes' pid header, and a request waiting for its model's workers to come back."""

from __future__ import annotations

import asyncio
import os
import select
import socket
from typing import Any

import pytest

from dynamo_graph.frontend.app import pid_header
from dynamo_graph.frontend.errors import HTTPError
from dynamo_graph.frontend.limits import Admission, FrontendLimits
from dynamo_graph.frontend.metrics import FrontendMetrics
from dynamo_graph.frontend.models import ModelRegistry
from dynamo_graph.frontend.openai_chat.serving import ChatHandler
from dynamo_graph.frontend.server import listen, take_backlog


def test_two_listeners_share_a_port_and_both_accept() -> None:
    first = listen("127.0.0.1", 0)
    port = first[0].getsockname()[1]
    second = listen("127.0.0.1", port)
    listeners = [*first, *second]
    for sock in listeners:
        sock.listen(64)
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
    accepted: set[int] = set()
    while len(accepted) < 2:
        ready, _, _ = select.select(listeners, [], [], 2.0)
        assert ready, "no connection arrived"
        for sock in ready:
            sock.accept()[0].close()
            accepted.add(listeners.index(sock))
    assert accepted == {0, 1}  # the kernel spread the connections over both
    for sock in [*clients, *listeners]:
        sock.close()


def test_a_closing_listener_hands_over_what_it_had_queued() -> None:
    """Connections the kernel completed on a listener nobody accepted from are served by the
    closing server, not reset: each one sent is received on an accepted socket."""
    (listener,) = listen("127.0.0.1", 0)
    listener.listen(64)
    port = listener.getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
    for n, client in enumerate(clients):
        client.sendall(b"request %d" % n)
    taken = take_backlog([listener])
    assert listener.fileno() == -1  # closed: the port is the other listeners' now
    assert len(taken) == 5
    for conn in taken:
        conn.setblocking(True)
        assert conn.recv(64).startswith(b"request ")
    for sock in [*clients, *taken]:
        sock.close()


def test_a_port_held_without_reuseport_is_an_error() -> None:
    with socket.socket() as plain:
        plain.bind(("127.0.0.1", 0))
        plain.listen()
        with pytest.raises(OSError):
            listen("127.0.0.1", plain.getsockname()[1])


def test_the_probes_name_the_process() -> None:
    assert pid_header() == (b"x-dyngraph-pid", str(os.getpid()).encode())


class _Named:
    """What the registry keeps of a pipeline here: its name."""

    def __init__(self, name: str) -> None:
        self.name = name


def _handler(registry: ModelRegistry, wait_s: float) -> ChatHandler:
    limits = FrontendLimits(model_wait_s=wait_s)
    return ChatHandler(registry, FrontendMetrics(), limits, Admission(limits))


class _Client:
    """The ASGI `receive` of a request whose body was read: it blocks until the client leaves."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}


def test_registry_routable_says_whether_a_request_has_a_worker() -> None:
    registry = ModelRegistry()
    workers: list[int] = []
    registry.add(_Named("remote"), routable=lambda: bool(workers))  # type: ignore[arg-type]
    registry.add(_Named("local"))  # type: ignore[arg-type]
    assert not registry.routable("remote") and registry.routable("local")
    assert not registry.routable("unknown")
    workers.append(1)
    assert registry.routable("remote")
    registry.remove("remote")
    assert not registry.routable("remote")


async def test_a_request_waits_for_a_worker_to_come_back() -> None:
    registry = ModelRegistry()
    workers: list[int] = []
    registry.add(_Named("m"), routable=lambda: bool(workers))  # type: ignore[arg-type]
    handler = _handler(registry, wait_s=5.0)
    asyncio.get_running_loop().call_later(0.2, workers.append, 1)
    waited = asyncio.get_running_loop().time()
    await handler._await_worker("m", _Client().receive, None)
    assert 0.15 <= asyncio.get_running_loop().time() - waited < 2.0
    await handler._await_worker("unknown", _Client().receive, None)  # at once: 404 comes next


async def test_no_worker_within_the_wait_is_503_with_retry_after() -> None:
    registry = ModelRegistry()
    registry.add(_Named("m"), routable=lambda: False)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(HTTPError) as err:
        await _handler(registry, wait_s=0.3)._await_worker("m", _Client().receive, None)
    assert 0.25 <= loop.time() - started < 2.0
    assert err.value.status == 503 and err.value.code == "model_unavailable"
    assert err.value.param == "model" and err.value.headers == [(b"retry-after", b"1")]
    # The request's own deadline bounds the wait too.
    started = loop.time()
    with pytest.raises(HTTPError):
        await _handler(registry, wait_s=30.0)._await_worker("m", _Client().receive, started + 0.2)
    assert loop.time() - started < 2.0
    # The model leaving the registry while a request waits: 503 at once, the request knew it.
    loop.call_later(0.1, registry.remove, "m")
    started = loop.time()
    with pytest.raises(HTTPError) as err:
        await _handler(registry, wait_s=30.0)._await_worker("m", _Client().receive, None)
    assert err.value.status == 503 and loop.time() - started < 2.0


async def test_a_client_that_leaves_stops_the_wait() -> None:
    registry = ModelRegistry()
    registry.add(_Named("m"), routable=lambda: False)  # type: ignore[arg-type]
    client = _Client()
    asyncio.get_running_loop().call_later(0.1, client.gone.set)
    with pytest.raises(ConnectionResetError):
        await _handler(registry, wait_s=30.0)._await_worker("m", client.receive, None)

"""The distributed runtime's Python API, shaped like Dynamo's (`DistributedRuntime`,
`Namespace`, `Component`, `Endpoint`, `Client`), so workers written for it run with only their
import lines changed.

One runtime per process: it owns the process's discovery lease, one request-plane server (made
on first `serve_endpoint`) and the request-plane clients. Payloads are msgpack: handlers get
plain Python objects (dicts) unless a typed `request_type` is given, and may yield dicts or
msgspec Structs.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from dynamo_graph.runtime import tracing
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.discovery import Discovery, create_discovery
from dynamo_graph.runtime.names import EndpointName, new_instance_id
from dynamo_graph.runtime.traffic import TrafficSplits, labels_from_env
from dynamo_graph.runtime.transport import create_client, create_server
from dynamo_graph.runtime.transport.base import RequestPlaneClient, RequestPlaneServer

if TYPE_CHECKING:
    from dynamo_graph.runtime.client import Client

log = logging.getLogger(__name__)

_encode = msgspec.msgpack.encode
_decode_any = msgspec.msgpack.Decoder()


class InstanceRecord(msgspec.Struct, omit_defaults=True):
    """The value of `v1/instances/{ns}/{comp}/{ep}/{id:x}`: where to send requests."""

    namespace: str
    component: str
    endpoint: str
    instance_id: int
    transport: dict[str, Any]
    subject: str
    # What a traffic split selects by (runtime/traffic.py), from DYN_INSTANCE_LABELS.
    labels: dict[str, str] = {}


class DistributedRuntime:
    def __init__(
        self,
        *,
        discovery: Discovery | None,
        request_plane: str | None = None,
        static: bool = False,
    ) -> None:
        self.discovery = discovery
        self.static = static
        self.request_plane = request_plane or os.environ.get("DYN_REQUEST_PLANE", "tcp")
        self.instance_id = new_instance_id()
        self._server: RequestPlaneServer | None = None
        self._server_lock = asyncio.Lock()
        self._clients: dict[str, RequestPlaneClient] = {}
        self._shutdown = asyncio.Event()
        self._served: list[Endpoint] = []
        self._closed = False
        self._traffic: TrafficSplits | None = None
        self._traffic_task: asyncio.Task[None] | None = None

    def traffic(self) -> TrafficSplits:
        """The components' traffic splits, followed by one watch started on first use."""
        if self._traffic is None:
            self._traffic = TrafficSplits()
            if self.discovery is not None:
                self._traffic_task = asyncio.create_task(
                    self._traffic.follow(self.discovery), name="traffic splits"
                )
        return self._traffic

    @classmethod
    async def create(
        cls,
        *,
        static: bool = False,
        discovery_backend: str | None = None,
        request_plane: str | None = None,
    ) -> DistributedRuntime:
        """A runtime configured from arguments, else env (DYN_DISCOVERY_BACKEND, DYN_REQUEST_PLANE, ...)."""
        discovery = None if static else create_discovery(discovery_backend)
        runtime = cls(discovery=discovery, request_plane=request_plane, static=static)
        create_client(runtime.request_plane)  # validates the plane's name and settings early
        if discovery is not None:
            await discovery.start()
        return runtime

    def namespace(self, name: str) -> Namespace:
        return Namespace(self, name)

    async def server(self) -> RequestPlaneServer:
        async with self._server_lock:
            if self._server is None:
                server = create_server(self.request_plane)
                await server.start()
                self._server = server
            return self._server

    def client_for(self, transport: dict[str, Any]) -> RequestPlaneClient:
        kind = next(iter(transport))
        client = self._clients.get(kind)
        if client is None:
            client = self._clients[kind] = create_client(kind)
        return client

    def shutdown(self) -> None:
        """Ask every `serve_endpoint` of this process to return (signal-safe)."""
        self._shutdown.set()

    async def wait_for_shutdown(self) -> None:
        await self._shutdown.wait()

    async def close(self, grace_s: float = 5.0) -> None:
        """Unregister everything, let streams in flight finish up to grace_s, release the lease.
        Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self._shutdown.set()
        for endpoint in list(self._served):
            await endpoint.unregister()
        if self._server is not None:
            await self._server.stop(grace_s)
        for client in self._clients.values():
            await client.close()
        if self._traffic_task is not None:
            self._traffic_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._traffic_task
        if self.discovery is not None:
            await self.discovery.close()


def static_subject(name: EndpointName) -> str:
    """The request-plane subject of an endpoint served without discovery."""
    return f"{name.namespace}.{name.component}.{name.endpoint}"


class Namespace:
    def __init__(self, runtime: DistributedRuntime, name: str) -> None:
        self.runtime = runtime
        self.name = name

    def component(self, name: str) -> Component:
        return Component(self, name)


class Component:
    def __init__(self, namespace: Namespace, name: str) -> None:
        self.namespace = namespace
        self.name = name

    async def create_service(self) -> None:
        """Kept for Dynamo compatibility: the request-plane server starts with the first endpoint."""
        await self.namespace.runtime.server()

    def endpoint(self, name: str) -> Endpoint:
        return Endpoint(self, name)


def _wants_context(handler: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(handler).parameters
    except (TypeError, ValueError):
        return False
    return len(params) >= 2


class Endpoint:
    def __init__(self, component: Component, name: str) -> None:
        self.component = component
        self.runtime = component.namespace.runtime
        self.name = EndpointName(component.namespace.name, component.name, name)
        self.subject = static_subject(self.name)
        if not self.runtime.static:
            # Dynamic instances are addressed one by one; static ones share the endpoint's name.
            self.subject += f"-{self.runtime.instance_id:x}"
        self._registered = False
        self.transport: dict[str, Any] = {}  # where callers reach this endpoint, once served

    @property
    def instance_id(self) -> int:
        return self.runtime.instance_id

    async def serve_endpoint(
        self,
        handler: Callable[..., AsyncIterator[Any]],
        *,
        request_type: type | None = None,
    ) -> None:
        """Serve until the runtime shuts down. `handler(request[, context])` yields responses.
        Shutdown is always graceful: unregister, then streams in flight get the runtime's grace."""
        await self.start_serving(handler, request_type=request_type)
        try:
            await self.runtime.wait_for_shutdown()
        finally:
            await self.unregister()

    async def start_serving(
        self, handler: Callable[..., AsyncIterator[Any]], *, request_type: type | None = None
    ) -> None:
        """Register and start taking requests, without blocking (for callers with their own loop)."""
        decode = msgspec.msgpack.Decoder(request_type).decode if request_type else _decode_any.decode
        with_context = _wants_context(handler)
        served_as = f"serve {self.name}"

        async def serve(payload: bytes, headers: dict[str, str], context: Context) -> AsyncIterator[bytes]:
            request = decode(payload)
            stream = handler(request, context) if with_context else handler(request)
            if tracing.ON and tracing.TRACEPARENT in headers:
                stream = tracing.served(served_as, stream, headers, context)
            async for item in stream:
                yield _encode(item)

        server = await self.runtime.server()
        transport = self.transport = server.register(self.subject, serve)
        record = InstanceRecord(
            namespace=self.name.namespace,
            component=self.name.component,
            endpoint=self.name.endpoint,
            instance_id=self.instance_id,
            transport=transport,
            subject=self.subject,
            labels=labels_from_env(),
        )
        discovery = self.runtime.discovery
        if discovery is not None:
            await discovery.put(self.name.instance_key(self.instance_id), msgspec.json.encode(record))
        self._registered = True
        self.runtime._served.append(self)
        log.info("serving %s as instance %x over %s", self.name, self.instance_id, transport)

    async def unregister(self) -> None:
        """Leave discovery and stop taking new requests; streams in flight go on."""
        if not self._registered:
            return
        self._registered = False
        discovery = self.runtime.discovery
        if discovery is not None:
            await discovery.delete(self.name.instance_key(self.instance_id))
        if self.runtime._server is not None:
            self.runtime._server.unregister(self.subject)

    async def client(self, router_mode: str = "round-robin") -> Client:
        from dynamo_graph.runtime.client import Client

        client = Client(self.runtime, self.name, router_mode=router_mode)
        await client.start()
        return client

"""The HTTP frontend: an ASGI dispatcher in front of a FastAPI app.

The two OpenAI generation routes go to plain ASGI handlers (openai_asgi.py), and so do
`GET /health` and `GET /live` (the readiness probes); everything else (models, metrics, docs,
errors) is ordinary FastAPI. Importing FastAPI costs ~0.3 s of CPU, so the FastAPI app is built
in a worker thread: on the first request that needs it, or API_WARMUP_S after the frontend
started, off the critical path of a graph coming up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dynamo_graph.frontend.errors import error_body
from dynamo_graph.frontend.metrics import FrontendMetrics
from dynamo_graph.frontend.models import ModelRegistry
from dynamo_graph.frontend.openai_asgi import DEFAULT_BODY_LIMIT, OpenAIHandler, Receive, Scope, Send

if TYPE_CHECKING:
    from fastapi import FastAPI
    from fastapi.responses import Response

API_WARMUP_S = 1.5  # after startup, build the FastAPI app in the background


def body_limit_from_env() -> int:
    """`DYN_HTTP_BODY_LIMIT_MB`, as Dynamo names it; 32 MiB by default."""
    raw = os.environ.get("DYN_HTTP_BODY_LIMIT_MB")
    try:
        return int(float(raw) * 1024 * 1024) if raw else DEFAULT_BODY_LIMIT
    except ValueError:
        return DEFAULT_BODY_LIMIT


def _error_response(status: int, message: str) -> Response:
    from fastapi.responses import Response

    return Response(error_body(status, message), status_code=status, media_type="application/json")


def health_body(models: ModelRegistry) -> tuple[int, dict[str, Any]]:
    """`GET /health`: 200 once a model is listed, else 503."""
    names = models.names()
    status = "healthy" if names else "unhealthy"
    return (200 if names else 503), {"status": status, "models": names, "details": models.health()}


LIVE_BODY = {"status": "live", "message": "Service is live"}


def build_api(models: ModelRegistry, metrics: FrontendMetrics) -> FastAPI:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    api = FastAPI(title="dyngraph frontend", version="0.1.0")

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return _error_response(exc.status_code, str(exc.detail))

    @api.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        return _error_response(400, str(exc.errors()))

    @api.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": models.list_models()}

    @api.get("/health")
    async def health() -> JSONResponse:
        status, body = health_body(models)
        return JSONResponse(body, status_code=status)

    @api.get("/live")
    async def live() -> dict[str, str]:
        return dict(LIVE_BODY)

    @api.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return api


async def _send_json(send: Send, status: int, content: Any) -> None:
    """A JSON response exactly as Starlette's JSONResponse renders it."""
    body = json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))
    data = body.encode("utf-8")
    headers = [(b"content-length", str(len(data)).encode()), (b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class FrontendApp:
    """ASGI entry point: the hot routes and the probes first, FastAPI (built lazily) for the rest."""

    def __init__(self, models: ModelRegistry, *, body_limit: int | None = None) -> None:
        body_limit = body_limit_from_env() if body_limit is None else body_limit
        self.models = models
        self.metrics = FrontendMetrics()
        self._api: FastAPI | None = None
        self._api_building: asyncio.Future[FastAPI] | None = None
        self.routes = {
            "/v1/chat/completions": OpenAIHandler("chat", models, self.metrics, body_limit),
            "/v1/completions": OpenAIHandler("completions", models, self.metrics, body_limit),
        }
        with contextlib.suppress(RuntimeError):  # no running loop: built on first use
            asyncio.get_running_loop().call_later(API_WARMUP_S, self._build_api_soon)

    def _build_api_soon(self) -> asyncio.Future[FastAPI]:
        if self._api_building is None:
            building = asyncio.to_thread(build_api, self.models, self.metrics)
            self._api_building = asyncio.ensure_future(building)
        return self._api_building

    async def api(self) -> FastAPI:
        """The FastAPI app for everything but the hot routes; built once, in a worker thread."""
        if self._api is None:
            self._api = await asyncio.shield(self._build_api_soon())
        return self._api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            handler = self.routes.get(path.rstrip("/") or "/")
            if handler is not None:
                await handler(scope, receive, send)
                return
            if scope["method"] == "GET" and path == "/health":
                await _send_json(send, *health_body(self.models))
                return
            if scope["method"] == "GET" and path == "/live":
                await _send_json(send, 200, LIVE_BODY)
                return
        await (self._api or await self.api())(scope, receive, send)


class NoDelayHttpToolsProtocol(HttpToolsProtocol):
    """Sets TCP_NODELAY on every accepted socket: without it small SSE writes on a kept-alive
    connection wait ~40 ms for the client's delayed ACK (seen in Dynamo 1.6.1, notes/DYNAMO.md)."""

    def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)


class GracefulServer(uvicorn.Server):
    """Exits normally after a graceful shutdown on SIGINT/SIGTERM. uvicorn re-raises the signal
    once it has shut down, so the process would die "killed by SIGTERM" and a supervisor could
    not tell a clean stop from a crash."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def make_server(app: FrontendApp, host: str, port: int) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http=NoDelayHttpToolsProtocol,
        lifespan="off",
        access_log=False,
        log_config=None,
        log_level="warning",
        timeout_graceful_shutdown=30,
    )
    return GracefulServer(config)

"""The HTTP frontend: an ASGI dispatcher in front of a FastAPI app.

The two OpenAI generation routes go to plain ASGI handlers (openai_asgi.py); everything else
(models, health, liveness, metrics, docs) is ordinary FastAPI.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dynamo_graph.frontend.errors import error_body
from dynamo_graph.frontend.metrics import FrontendMetrics
from dynamo_graph.frontend.models import ModelRegistry
from dynamo_graph.frontend.openai_asgi import DEFAULT_BODY_LIMIT, OpenAIHandler, Receive, Scope, Send


def body_limit_from_env() -> int:
    """`DYN_HTTP_BODY_LIMIT_MB`, as Dynamo names it; 32 MiB by default."""
    raw = os.environ.get("DYN_HTTP_BODY_LIMIT_MB")
    try:
        return int(float(raw) * 1024 * 1024) if raw else DEFAULT_BODY_LIMIT
    except ValueError:
        return DEFAULT_BODY_LIMIT


def _error_response(status: int, message: str) -> Response:
    return Response(error_body(status, message), status_code=status, media_type="application/json")


def build_api(models: ModelRegistry, metrics: FrontendMetrics) -> FastAPI:
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
        names = models.names()
        status = "healthy" if names else "unhealthy"
        body = {"status": status, "models": names, "details": models.health()}
        return JSONResponse(body, status_code=200 if names else 503)

    @api.get("/live")
    async def live() -> dict[str, str]:
        return {"status": "live", "message": "Service is live"}

    @api.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return api


class FrontendApp:
    """ASGI entry point: the hot routes first, FastAPI for the rest."""

    def __init__(self, models: ModelRegistry, *, body_limit: int | None = None) -> None:
        body_limit = body_limit_from_env() if body_limit is None else body_limit
        self.models = models
        self.metrics = FrontendMetrics()
        self.api = build_api(models, self.metrics)
        self.routes = {
            "/v1/chat/completions": OpenAIHandler("chat", models, self.metrics, body_limit),
            "/v1/completions": OpenAIHandler("completions", models, self.metrics, body_limit),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            handler = self.routes.get(scope["path"].rstrip("/") or "/")
            if handler is not None:
                await handler(scope, receive, send)
                return
        await self.api(scope, receive, send)


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

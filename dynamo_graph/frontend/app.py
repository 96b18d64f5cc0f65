"""The HTTP frontend: an ASGI dispatcher in front of a FastAPI app, and the OpenAPI document.

The generation routes go to plain ASGI handlers (a package per API surface, on openai_asgi.py,
each exporting its routes as a `Surface`: `SURFACES` lists them), and so do `GET /health` and
`GET /live` (the readiness probes); everything else (models, metrics, docs, errors) is ordinary
FastAPI. Importing FastAPI costs ~0.3 s of CPU, so the FastAPI app is built in a worker thread:
on the first request that needs it, or API_WARMUP_S after the frontend started, off the critical
path of a graph coming up. The uvicorn server it runs in is server.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dynamo_graph.frontend import (
    anthropic_messages,
    generate_tokens,
    openai_chat,
    openai_completions,
    openai_embeddings,
    openai_responses,
    openapi,
)
from dynamo_graph.frontend.auth import ApiKeys, Guard, protected_path, send_unauthorized
from dynamo_graph.frontend.errors import error_body
from dynamo_graph.frontend.limits import Admission, FrontendLimits, body_limit_from_env
from dynamo_graph.frontend.metrics import FrontendMetrics
from dynamo_graph.frontend.models import ModelRegistry
from dynamo_graph.frontend.openai_asgi import PID_HEADER, Receive, Scope, Send
from dynamo_graph.frontend.record import Recorder
from dynamo_graph.frontend.tenants import TENANT_SCOPE, Tenants

if TYPE_CHECKING:
    from fastapi import FastAPI
    from fastapi.responses import Response

    from dynamo_graph.frontend.lora import AdapterAdmin

log = logging.getLogger(__name__)
API_WARMUP_S = 1.5  # after startup, build the FastAPI app in the background

# The generation routes, one API surface per package: adding one is its package and a line here.
SURFACES = (
    openai_chat.SURFACE,
    openai_completions.SURFACE,
    openai_responses.SURFACE,
    anthropic_messages.SURFACE,
    openai_embeddings.SURFACE,
    generate_tokens.SURFACE,
)


PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def _error_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> Response:
    from fastapi.responses import Response

    body = error_body(status, message)
    return Response(body, status_code=status, headers=headers, media_type="application/json")


def health_body(models: ModelRegistry) -> tuple[int, dict[str, Any]]:
    """`GET /health`: 200 while some listed model has an instance that can take requests (an
    in-process model always can), else 503 — so a load balancer stops sending here when every
    worker is wedged, not only when none is registered."""
    names = models.names()
    details = models.health()
    serving = any(d.get("status") == "healthy" for d in details.values())
    return (200 if serving else 503), {
        "status": "healthy" if serving else "unhealthy",
        "models": names,
        "details": details,
    }


LIVE_BODY = {"status": "live", "message": "Service is live"}


def build_api(
    models: ModelRegistry, metrics: FrontendMetrics, api_keys: Guard | None = None, *, strict: bool = True
) -> FastAPI:
    """`api_keys`: the keys the dispatcher checks, so the OpenAPI document says which routes need
    one; `strict`: whether request bodies refuse undeclared fields (FrontendLimits)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    api = FastAPI(title="dyngraph frontend", version="0.1.0")

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        # Starlette's 405 carries `Allow` (RFC 9110): keep its headers.
        return _error_response(exc.status_code, str(exc.detail), exc.headers)

    @api.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        return _error_response(400, str(exc.errors()))

    async def list_models(request: Request) -> dict[str, Any]:
        listed = models.list_models()
        tenant = request.scope.get(TENANT_SCOPE)
        if tenant is not None:  # a tenant sees only the models its key may use
            listed = [m for m in listed if tenant.tenant.allows(m["id"])]
        return {"object": "list", "data": listed}

    # FastAPI is imported here, not at module level: give it the class, not the name.
    list_models.__annotations__["request"] = Request
    api.get("/v1/models", response_model=None)(list_models)

    @api.get("/health", response_model=None)
    async def health() -> JSONResponse:
        status, body = health_body(models)
        return JSONResponse(body, status_code=status)

    @api.get("/live", response_model=None)
    async def live() -> dict[str, str]:
        return dict(LIVE_BODY)

    @api.get("/metrics", response_model=None, response_class=PlainTextResponse)
    async def prometheus() -> Response:
        return Response(await metrics.scrape(), media_type=PROMETHEUS_TEXT)

    default_openapi = api.openapi

    def document() -> dict[str, Any]:
        if api.openapi_schema is None:
            api.openapi_schema = openapi.complete(default_openapi(), SURFACES, api_keys, strict=strict)
        return api.openapi_schema

    api.openapi = document  # type: ignore[method-assign]
    return api


def pid_header() -> tuple[bytes, bytes]:
    """`x-dyngraph-pid` on the probes' answers: two frontends of a graph share a port while one
    replaces the other (server.py), and the supervisor's readiness probe must know which answered."""
    return PID_HEADER


async def _send_json(send: Send, status: int, content: Any) -> None:
    """A JSON response exactly as Starlette's JSONResponse renders it, with `pid_header`."""
    body = json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))
    data = body.encode("utf-8")
    headers = [
        (b"content-length", str(len(data)).encode()),
        (b"content-type", b"application/json"),
        pid_header(),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class FrontendApp:
    """ASGI entry point: the hot routes and the probes first, FastAPI (built lazily) for the rest."""

    def __init__(
        self,
        models: ModelRegistry,
        *,
        body_limit: int | None = None,
        limits: FrontendLimits | None = None,
        api_keys: ApiKeys | None = None,
        tenants: Tenants | None = None,
        lora: AdapterAdmin | None = None,
        recorder: Recorder | None = None,
        stream_interval: int = 1,
    ) -> None:
        """`tenants`: the keys file's (frontend/tenants.py), beside `api_keys`; `lora`: serve
        the LoRA adapter routes (frontend/lora.py) through it; `recorder`: record the requests
        served (frontend/record.py); `stream_interval`: tokens per streamed event after the
        first (frontend/interval.py)."""
        if limits is None:
            limits = FrontendLimits(body_limit=body_limit_from_env() if body_limit is None else body_limit)
        self.models = models
        self.limits = limits
        self.recorder = recorder
        self.api_keys = api_keys if api_keys else None
        self.tenants = tenants
        self.guarded = self.api_keys is not None or tenants is not None
        self.metrics = FrontendMetrics()
        if tenants is not None:
            self.metrics.registry.register(tenants)
        self.admission = Admission(limits)
        self.metrics.registry.register(self.admission)
        self._api: FastAPI | None = None
        self._api_building: asyncio.Future[FastAPI] | None = None
        self.routes = {
            route.path: route.handler(
                models, self.metrics, limits, self.admission, recorder, stream_interval=stream_interval
            )
            for surface in SURFACES
            for route in surface.routes
        }
        if lora is not None:
            from dynamo_graph.frontend.lora import LOAD_PATH, UNLOAD_PATH, LoraRoutes

            routes = LoraRoutes(lora, limits.body_limit)
            self.routes.update({LOAD_PATH: routes, UNLOAD_PATH: routes})
        with contextlib.suppress(RuntimeError):  # no running loop: built on first use
            asyncio.get_running_loop().call_later(API_WARMUP_S, self._build_api_soon)

    def _build_api_soon(self) -> asyncio.Future[FastAPI]:
        if self._api_building is None:
            guard: Guard | None = self.tenants or self.api_keys
            strict = self.limits.reject_unknown_fields
            building = asyncio.to_thread(build_api, self.models, self.metrics, guard, strict=strict)
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
            if self.guarded and protected_path(path) and not self._authenticate(scope):
                self.admission.count("unauthorized")
                # Never the key or the Authorization header: only that the check failed.
                log.debug("401 for %s %s from %s", scope["method"], path, scope.get("client"))
                await send_unauthorized(send, scope["headers"], handler.error_body if handler else None)
                return
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

    def _authenticate(self, scope: Scope) -> bool:
        """Whether the request presents a key: a tenant's (then in `scope[TENANT_SCOPE]`), or
        one of `api_keys`."""
        token = ApiKeys.presented(scope["headers"])
        tenant = self.tenants.find(token) if self.tenants is not None else None
        if tenant is not None:
            scope[TENANT_SCOPE] = tenant
            return True
        return self.api_keys is not None and self.api_keys.matches(token)

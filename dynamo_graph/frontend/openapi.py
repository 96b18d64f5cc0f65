"""The OpenAPI document (`GET /openapi.json`): what each route takes and what it answers.

FastAPI documents its own routes (models, health, metrics); the generation routes are raw ASGI
(openai_asgi.py), so their operations are written here: each request body's schema is generated
from the msgspec type its handler decodes into (the constraints msgspec enforces, and those the
pipeline enforces, declared beside the fields with `Meta`), so the document and the validation
cannot drift. Each operation lists the statuses it answers, its error body (OpenAI's or
Anthropic's), server-sent events where the request can ask for a stream, and, when the frontend
has API keys, the security schemes that `auth.py` checks. A fuzzer with every check on
(`make fuzz-api`, tests/system/test_openapi_fuzz.py) holds the server to this document.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from dynamo_graph.frontend.auth import Guard
from dynamo_graph.frontend.errors import OPENAI_ERROR, ErrorSchema, strict_decoder
from dynamo_graph.frontend.openai_asgi import Route, Surface

# What every generation route may answer besides 200, and why.
GENERATION_ERRORS = (
    (400, "Invalid request; `param` names the field"),
    (404, "Unknown model, or a model that does not serve this route (`param`: model)"),
    (408, "The request body did not arrive within the request time limit"),
    (413, "Request body too large"),
    (415, "Not JSON"),
    (500, "The server failed"),
    (503, "At the concurrency limit, or the model's workers are all gone for now; see Retry-After"),
    (504, "Past the request time limit"),
    (529, "The router's queue is full; see Retry-After (503 with DYN_HTTP_OVERLOAD_STATUS_CODE=503)"),
)
UNAUTHORIZED = (401, "Missing or wrong API key")
RATE_LIMITED = (429, "Past a limit of the key's tenant (keys file); see Retry-After")
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait", "schema": {"type": "integer"}}}
# Where auth.py reads a key: `Authorization: Bearer KEY`, or `x-api-key: KEY` as Anthropic's clients send it.
SECURITY_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer"},
    "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
}
SECURITY = [{"bearer": []}, {"apiKey": []}]

_JSON_OBJECT = {"type": "object"}
# One server-sent event (OpenAPI 3.1: a stream's `schema` describes each event).
SSE_EVENT = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["data"],
}
_HEALTH = {
    "type": "object",
    "properties": {
        "status": {"enum": ["healthy", "unhealthy"]},
        "models": {"type": "array", "items": {"type": "string"}},
        "details": {"type": "object"},
    },
    "required": ["status", "models", "details"],
}
_MODEL_LIST = {
    "type": "object",
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "string"},
                    "object": {"const": "model"},
                    "created": {"type": "integer"},
                    "owned_by": {"type": "string"},
                    "context_window": {"type": ["integer", "null"]},
                    "endpoints": {"type": "array", "items": {"type": "string"}},
                    "parent": {"type": ["string", "null"]},
                },
                "required": ["id", "object", "created", "owned_by"],
            },
        },
    },
    "required": ["object", "data"],
}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error_ref(error: ErrorSchema) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{error.name}"}


def _streams(route: Route) -> bool:
    """Whether the route's request can ask for server-sent events (it has a `stream` field)."""
    return any(field.name == "stream" for field in msgspec.structs.fields(route.handler.decoder.type))


def _answers(route: Route, error: ErrorSchema, protected: bool) -> dict[str, Any]:
    content = {"application/json": {"schema": _JSON_OBJECT}}
    description = "The answer"
    if _streams(route):
        content["text/event-stream"] = {"schema": SSE_EVENT}
        description = "The answer, or with `stream: true` server-sent events"
    statuses = [*GENERATION_ERRORS, UNAUTHORIZED, RATE_LIMITED] if protected else GENERATION_ERRORS
    responses: dict[str, Any] = {"200": {"description": description, "content": content}}
    for code, text in sorted(statuses):
        responses[str(code)] = _json(_error_ref(error), text)
        if code in (429, 503, 529):
            responses[str(code)]["headers"] = RETRY_AFTER
    return responses


def _get_routes(paths: dict[str, Any], keys: Guard | None) -> None:
    """The FastAPI routes' answers as they are, not FastAPI's guess."""
    models = paths["/v1/models"]["get"]
    models["responses"] = {"200": _json(_MODEL_LIST, "The models served now")}
    if keys is not None and keys.protects("/v1/models"):
        models["responses"]["401"] = _json(_error_ref(OPENAI_ERROR), UNAUTHORIZED[1])
        models["security"] = SECURITY
    paths["/health"]["get"]["responses"] = {
        "200": _json(_HEALTH, "Some model has an instance that can take requests"),
        "503": _json(_HEALTH, "No model can take requests"),
    }
    paths["/live"]["get"]["responses"] = {"200": _json(_JSON_OBJECT, "The process is up")}
    text = {"text/plain": {"schema": {"type": "string"}}}
    paths["/metrics"]["get"]["responses"] = {
        "200": {"description": "Prometheus text exposition format 0.0.4", "content": text}
    }


def complete(
    doc: dict[str, Any], surfaces: Sequence[Surface], keys: Guard | None, *, strict: bool = True
) -> dict[str, Any]:
    """FastAPI's document with the generation routes, the errors and, with `keys`, security;
    `strict`: request bodies refuse fields they do not declare (`--http-unknown-fields`)."""
    routes = [(route, surface.error) for surface in surfaces for route in surface.routes]
    decoders = [route.handler.decoder for route, _ in routes]
    if strict:
        decoders = [strict_decoder(decoder) for decoder in decoders]
    bodies, components = msgspec.json.schema_components(
        [decoder.type for decoder in decoders], ref_template="#/components/schemas/{name}"
    )
    root = doc.setdefault("components", {})
    schemas = root.setdefault("schemas", {})
    schemas.update(components)
    schemas[OPENAI_ERROR.name] = OPENAI_ERROR.schema
    for surface in surfaces:
        schemas[surface.error.name] = surface.error.schema
    paths = doc.setdefault("paths", {})
    _get_routes(paths, keys)
    if keys is not None:
        root["securitySchemes"] = SECURITY_SCHEMES
    for (route, error), schema in zip(routes, bodies, strict=True):
        protected = keys is not None and keys.protects(route.path)
        operation: dict[str, Any] = {
            "summary": route.summary,
            "operationId": route.path.strip("/").replace("/", "_"),
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": _answers(route, error, protected),
        }
        if protected:
            operation["security"] = SECURITY
        paths[route.path] = {"post": operation}
    return doc

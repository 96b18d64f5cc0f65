"""A bounded property-based fuzz of the HTTP API (hypothesis, fixed seed).

Request bodies are drawn from the frontend's own OpenAPI document (GET /openapi.json: the
generation routes' schemas are generated from the msgspec types the handlers decode into), with
the model name sometimes right, mixed with arbitrary JSON, raw bytes, odd content types,
methods and paths. Nothing may earn a 5xx; errors are OpenAI error bodies; the server is alive
and answering afterwards.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.processes import ServerProcess, echo_core_args, running_server

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

BUDGET_S = 40.0  # wall time of the whole fuzz run, at most
HOT = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
    "/inference/v1/generate",
)
ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")
# How a complete stream ends, per route: its last SSE line.
STREAM_ENDS = {
    "/v1/chat/completions": ("data: [DONE]",),
    "/v1/completions": ("data: [DONE]",),
    "/v1/responses": tuple(f'data: {{"type":"response.{s}"' for s in ("completed", "incomplete", "failed")),
    "/v1/messages": ('data: {"type":"message_stop"', 'data: {"type":"error"'),
    "/inference/v1/generate": ("data: [DONE]",),
}
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    limits = ["--context-length", "128", "--http-body-limit-mb", "0.0625", "--request-timeout-s", "10"]
    args = echo_core_args(tiny_model, MODEL, *limits)
    with running_server(args, log_dir=tmp_path_factory.mktemp("logs")) as proc:
        yield proc


# ---- JSON Schema -> hypothesis strategy (the subset msgspec emits) --------------------------

_TEXT = st.text(max_size=24)
_JSON_LEAF = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | _TEXT
)
JUNK_JSON = st.recursive(
    _JSON_LEAF,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=12,
)


def from_schema(schema: dict[str, Any], defs: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    if depth > 5:
        return _JSON_LEAF
    if "$ref" in schema:
        return st.deferred(lambda: from_schema(defs[schema["$ref"].rsplit("/", 1)[-1]], defs, depth + 1))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs, depth + 1) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}, defs, depth) for k in kind])
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        fields = {
            name: from_schema(sub, defs, depth + 1) for name, sub in props.items() if name not in required
        }
        needed = {name: from_schema(props[name], defs, depth + 1) for name in required if name in props}
        if not props:
            return st.dictionaries(_TEXT, _JSON_LEAF, max_size=3)
        return st.fixed_dictionaries(needed, optional=fields)
    if kind == "array":
        items = from_schema(schema.get("items", {}), defs, depth + 1) if "items" in schema else _JSON_LEAF
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=3)
    if kind == "string":
        return _TEXT
    if kind == "integer":
        low = schema.get("minimum", schema.get("exclusiveMinimum", -(2**40)))
        high = schema.get("maximum", 2**40)
        edge = st.sampled_from([low, high, low - 1, high + 1, 0, 1, 2**63])
        return st.integers(min_value=low, max_value=high) | edge
    if kind == "number":
        return st.floats(allow_nan=False, allow_infinity=False, width=32) | st.sampled_from([-1e300, 1e300])
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return _JSON_LEAF


def _body_strategy(doc: dict[str, Any], path: str) -> st.SearchStrategy[bytes]:
    schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    defs = doc["components"]["schemas"]
    typed = from_schema(schema, defs)

    def aim(body: Any, right_model: bool) -> Any:
        if isinstance(body, dict) and right_model:
            body = {**body, "model": MODEL}
        return body

    valid_ish = st.builds(aim, typed, st.booleans())
    as_json = st.one_of(valid_ish, valid_ish, JUNK_JSON).map(
        lambda v: json.dumps(v, allow_nan=False).encode()
    )
    return st.one_of(as_json, as_json, as_json, st.binary(max_size=64))


CONTENT_TYPES = [None, "application/json", "text/plain", "application/json; charset=latin-1", "a/b+json", ""]


def test_fuzz_the_http_api(server: ServerProcess) -> None:
    base = server.base_url
    doc = httpx.get(f"{base}/openapi.json", timeout=30).json()
    assert set(HOT) <= set(doc["paths"])  # the raw-ASGI routes are in the document
    request = st.one_of(
        st.tuples(
            st.just("POST"),
            st.sampled_from(HOT).flatmap(lambda p: st.tuples(st.just(p), _body_strategy(doc, p))),
        ),
        st.tuples(
            st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
            st.tuples(
                st.sampled_from(
                    [*HOT, "/v1/models", "/health", "/live", "/metrics", "/openapi.json", "/v1/x"]
                ),
                st.binary(max_size=16),
            ),
        ),
    )
    started = time.monotonic()
    seen: dict[int, int] = {}
    http = httpx.Client(timeout=30)

    @seed(20261121)
    @settings(
        max_examples=1200,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(request, st.sampled_from(CONTENT_TYPES), st.booleans())
    def probe(req: tuple[str, tuple[str, bytes]], content_type: str | None, stream_usage: bool) -> None:
        if time.monotonic() - started > BUDGET_S:
            return
        method, (path, body) = req
        headers = {"content-type": content_type} if content_type is not None else {}
        resp = http.request(method, f"{base}{path}", content=body, headers=headers)
        seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
        assert resp.status_code < 500, (method, path, body[:300], resp.status_code, resp.text[:500])
        if path in HOT and 400 <= resp.status_code < 500 and method != "HEAD":
            error = resp.json()
            assert "error" in error, resp.text
            assert (error.get("type") == "error") == (path in ANTHROPIC), resp.text
        if path in HOT and resp.status_code == 200 and resp.headers["content-type"] == "text/event-stream":
            last = resp.text.rstrip().rsplit("\n", 1)[-1]
            assert last.startswith(STREAM_ENDS[path]), resp.text[-300:]
        del stream_usage

    try:
        probe()
    finally:
        http.close()
    print("fuzz statuses", sorted(seen.items()))
    assert sum(seen.values()) >= 100, seen
    assert seen.get(200, 0) > 0 and any(400 <= s < 500 for s in seen), seen  # both kinds were hit
    # Alive and answering afterwards.
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200
    body = {"model": MODEL, "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 3}
    reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=10)
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length"
    assert server.proc.poll() is None
    assert "Traceback" not in server.log(), server.log()[-3000:]

"""Every kind of bad request gets a 4xx OpenAI error body naming the problem; the server lives on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.processes import ServerProcess

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # A small context and body limit so the limits can be hit with small requests.
    proc = ServerProcess(
        ["out=echo_core", "--model-path", str(tiny_model), "--model-name", "tiny", "--context-length", "64"],
        env={"DYN_HTTP_BODY_LIMIT_MB": "0.25"},
        log_dir=tmp_path_factory.mktemp("logs"),
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"

# (id, path, body (dict or raw bytes), status, param or None, words the message must contain)
CASES = [
    ("malformed-json", CHAT, b'{"model": "tiny", "messages": [', 400, None, "malformed"),
    ("not-an-object", CHAT, b"[1, 2, 3]", 400, None, "object"),
    ("missing-model", CHAT, {"messages": MSG}, 400, "model", "model"),
    ("missing-messages", CHAT, {"model": "tiny"}, 400, "messages", "messages"),
    ("messages-not-list", CHAT, {"model": "tiny", "messages": "hi"}, 400, "messages", "array"),
    ("empty-messages", CHAT, {"model": "tiny", "messages": []}, 400, "messages", "messages"),
    (
        "bad-role",
        CHAT,
        {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages[0].role",
        "wizard",
    ),
    (
        "content-wrong-type",
        CHAT,
        {"model": "tiny", "messages": [{"role": "user", "content": 5}]},
        400,
        "messages[0].content",
        "content",
    ),
    (
        "max-tokens-string",
        CHAT,
        {"model": "tiny", "messages": MSG, "max_tokens": "ten"},
        400,
        "max_tokens",
        "max_tokens",
    ),
    (
        "max-tokens-negative",
        CHAT,
        {"model": "tiny", "messages": MSG, "max_tokens": -1},
        400,
        "max_tokens",
        "at least 1",
    ),
    (
        "temperature-range",
        CHAT,
        {"model": "tiny", "messages": MSG, "temperature": 5},
        400,
        "temperature",
        "<= 2.0",
    ),
    ("top-p-range", CHAT, {"model": "tiny", "messages": MSG, "top_p": 1.5}, 400, "top_p", "top_p"),
    ("n-zero", CHAT, {"model": "tiny", "messages": MSG, "n": 0}, 400, "n", ">= 1"),
    ("n-unsupported", CHAT, {"model": "tiny", "messages": MSG, "n": 3}, 400, "n", "n"),
    ("stop-wrong-type", CHAT, {"model": "tiny", "messages": MSG, "stop": 42}, 400, "stop", "stop"),
    ("stream-wrong-type", CHAT, {"model": "tiny", "messages": MSG, "stream": "yes"}, 400, "stream", "bool"),
    ("unknown-model", CHAT, {"model": "nope", "messages": MSG}, 404, "model", "nope"),
    (
        "prompt-too-long",
        CHAT,
        {"model": "tiny", "messages": [{"role": "user", "content": "word " * 200}]},
        400,
        "messages",
        "64",
    ),
    (
        "prompt-plus-max-tokens",
        CHAT,
        {"model": "tiny", "messages": MSG, "max_tokens": 60},
        400,
        "messages",
        "60",
    ),
    (
        "min-tokens-over-max",
        CHAT,
        {"model": "tiny", "messages": MSG, "max_tokens": 2, "min_tokens": 5},
        400,
        "min_tokens",
        "min_tokens",
    ),
    ("completion-empty-prompt", COMP, {"model": "tiny", "prompt": ""}, 400, "prompt", "prompt"),
    ("completion-bad-token-id", COMP, {"model": "tiny", "prompt": [1, 999999]}, 400, "prompt", "999999"),
    ("completion-batched", COMP, {"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt", "prompt"),
    ("completion-missing-prompt", COMP, {"model": "tiny"}, 400, "prompt", "prompt"),
    (
        "logit-bias-range",
        CHAT,
        {"model": "tiny", "messages": MSG, "logit_bias": {"5": 500}},
        400,
        "logit_bias",
        "100",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request_is_4xx_naming_the_field(server: ServerProcess, case: tuple) -> None:
    _, path, body, status, param, words = case
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    resp = httpx.post(server.base_url + path, timeout=10, **kwargs)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    assert words.lower() in error["message"].lower(), error


def test_wrong_content_type_is_415(server: ServerProcess) -> None:
    resp = httpx.post(server.base_url + CHAT, content=b"model=tiny", headers={"content-type": "text/plain"})
    assert resp.status_code == 415
    assert "application/json" in resp.json()["error"]["message"]


def test_body_too_large_is_413(server: ServerProcess) -> None:
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 400_000}]}
    resp = httpx.post(server.base_url + CHAT, json=big, timeout=10)
    assert resp.status_code == 413
    assert "limit" in resp.json()["error"]["message"]


def test_get_on_post_route_is_405(server: ServerProcess) -> None:
    resp = httpx.get(server.base_url + CHAT)
    assert resp.status_code == 405
    assert "error" in resp.json()


def test_unknown_path_is_404_with_openai_body(server: ServerProcess) -> None:
    resp = httpx.get(server.base_url + "/v1/nothing")
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == 404


def test_server_still_serves_after_bad_requests(server: ServerProcess) -> None:
    for case in CASES:
        body = case[2]
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        httpx.post(server.base_url + case[1], timeout=10, **kwargs)
    resp = httpx.post(
        server.base_url + CHAT, json={"model": "tiny", "messages": MSG, "max_tokens": 5}, timeout=10
    )
    assert resp.status_code == 200
    assert resp.json()["usage"]["completion_tokens"] == 5
    assert server.proc.poll() is None
    assert "Traceback" not in server.log()

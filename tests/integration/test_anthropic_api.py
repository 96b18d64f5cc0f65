"""`POST /v1/messages` and `/v1/messages/count_tokens` through the official `anthropic` client.

Against `out=echo_core` (the answer is the templated prompt, so the conversion of `system` and
`messages` into the chat template is checked exactly) and against agent_engine.py with the
hermes tool-call parser and the qwen3 reasoning parser, for a `tool_use` round trip; with an API
key on the agent server, which the client sends as `x-api-key`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.http_streams import abandon_stream, cancelled_streams, paced_server
from tests.support.metrics import metric
from tests.support.processes import ServerProcess
from tests.support.scripts import SCRIPTS

anthropic = pytest.importorskip("anthropic")

ENGINE = SCRIPTS / "agent_engine.py"
QUESTION = "What is the capital of Tuvalu?"
HEADER = "<|start_header_id|>{}<|end_header_id|>\n\n"
TEMPLATED = (
    "<|begin_of_text|>"
    + HEADER.format("system")
    + "Answer briefly.<|eot_id|>"
    + HEADER.format("user")
    + QUESTION
    + "<|eot_id|>"
    + HEADER.format("assistant")
)
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
CITY = "Funafuti"
KEY = "sk-test-anthropic"


@pytest.fixture(scope="module")
def echo(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    proc = ServerProcess(
        ["out=echo_core", "--model-path", str(tiny_model)], log_dir=tmp_path_factory.mktemp("logs")
    )
    try:
        proc.wait_ready()
        client = anthropic.Anthropic(base_url=proc.base_url, api_key="x", max_retries=0, timeout=30)
        yield client, tiny_model.name, proc
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def agent(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    args = [f"out=pytok:{ENGINE}", "--model-path", str(tiny_model), "--dyn-tool-call-parser", "hermes"]
    args += ["--dyn-reasoning-parser", "qwen3", "--api-key", KEY]
    env = {"AGENT_FORMAT": "hermes", "AGENT_THINK": "qwen3"}
    proc = ServerProcess(args, env=env, log_dir=tmp_path_factory.mktemp("logs"))
    try:
        proc.wait_ready()
        client = anthropic.Anthropic(base_url=proc.base_url, api_key=KEY, max_retries=0, timeout=30)
        yield client, tiny_model.name, proc
    finally:
        assert proc.stop() == 0, proc.log()


def ask(client, model: str, **kw):
    kw.setdefault("max_tokens", 200)
    messages = [{"role": "user", "content": QUESTION}]
    return client.messages.create(model=model, system="Answer briefly.", messages=messages, **kw)


def test_plain(echo: tuple) -> None:
    client, model, _ = echo
    msg = ask(client, model)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    (block,) = msg.content
    assert block.type == "text" and block.text == TEMPLATED.split("<|eot_id|>")[0]
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.usage.input_tokens > 20 and msg.usage.output_tokens > 5


def test_content_blocks_become_the_template(echo: tuple) -> None:
    client, model, _ = echo
    msg = client.messages.create(
        model=model,
        max_tokens=200,
        system=[{"type": "text", "text": "Answer briefly."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
        extra_body={"nvext": {"ignore_eos": True}},
    )
    assert msg.content[0].text == TEMPLATED


def test_stream_events_in_order(echo: tuple) -> None:
    client, model, _ = echo
    with client.messages.stream(
        model=model,
        max_tokens=200,
        system="Answer briefly.",
        messages=[{"role": "user", "content": QUESTION}],
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type != "text"]  # "text": the helper's own per-delta event
    deltas = kinds.count("content_block_delta")
    assert deltas > 5
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert final.content[0].text == TEMPLATED.split("<|eot_id|>")[0]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 5


def test_max_tokens_and_stop_sequences(echo: tuple) -> None:
    client, model, _ = echo
    msg = ask(client, model, max_tokens=3)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3
    msg = ask(client, model, stop_sequences=["capital"], extra_body={"nvext": {"ignore_eos": True}})
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "capital"
    assert msg.content[0].text == TEMPLATED.split("capital")[0]
    with client.messages.stream(
        model=model, max_tokens=3, messages=[{"role": "user", "content": QUESTION}]
    ) as stream:
        assert stream.get_final_message().stop_reason == "max_tokens"


def test_count_tokens(echo: tuple) -> None:
    client, model, _ = echo
    counted = client.messages.count_tokens(
        model=model, system="Answer briefly.", messages=[{"role": "user", "content": QUESTION}]
    )
    assert counted.input_tokens == ask(client, model).usage.input_tokens


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 100000, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 5, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "hi"}]},
            "temperature",
        ),
    ],
)
def test_bad_input_gets_anthropic_errors(echo: tuple, body: dict, field: str) -> None:
    _, model, proc = echo
    reply = httpx.post(f"{proc.base_url}/v1/messages", json={"model": model, **body}, timeout=10)
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert f"`{field}`" in error["error"]["message"], error


def test_unknown_model_is_not_found(echo: tuple) -> None:
    client, _, _ = echo
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(
            model="no-such-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.body["error"]["type"] == "not_found_error"


def test_tool_use_round_trip(agent: tuple) -> None:
    client, model, _ = agent
    messages: list[dict] = [{"role": "user", "content": CITY}]
    first = client.messages.create(model=model, max_tokens=300, messages=messages, tools=TOOLS)
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["thinking", "text", "tool_use"]
    assert "characters of help" in first.content[0].thinking
    assert first.content[1].text == "Let me look that up.\n"
    call = first.content[2]
    assert call.name == "get_weather" and call.input == {"city": CITY}

    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 31 C"}],
        },
    ]
    final = client.messages.create(model=model, max_tokens=300, messages=messages, tools=TOOLS)
    assert final.stop_reason == "end_turn"
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[1].text == "The tool says: sunny, 31 C"


def test_tool_use_streamed(agent: tuple) -> None:
    client, model, _ = agent
    with client.messages.stream(
        model=model, max_tokens=300, messages=[{"role": "user", "content": CITY}], tools=TOOLS
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert {"thinking_delta", "text_delta", "input_json_delta"} == set(deltas)
    partial = "".join(
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    assert json.loads(partial) == {"city": CITY}
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"city": CITY}


def test_api_key_is_required(agent: tuple) -> None:
    _, model, proc = agent
    wrong = anthropic.Anthropic(base_url=proc.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model=model, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Incorrect API key provided."},
    }


def test_client_disconnect_cancels_generation(tiny_model: Path, tmp_path: Path) -> None:
    """A slow stream abandoned after its first delta is cancelled, not run to the end."""
    proc = paced_server(tiny_model, tmp_path, 100)
    try:
        body = {
            "model": tiny_model.name,
            "max_tokens": 100,
            "messages": [{"role": "user", "content": QUESTION}],
            "stream": True,
            "nvext": {"ignore_eos": True},
        }
        abandon_stream(proc, "/v1/messages", body, "text_delta")
        assert cancelled_streams(proc, "messages", tiny_model.name) == 1
        assert metric(proc, "dynamo_frontend_inflight_requests") == 0
    finally:
        proc.stop()


def test_failure_mid_stream(tiny_model: Path, tmp_path: Path) -> None:
    """An engine failure after the stream began: Anthropic's `error` event, which the SDK raises."""
    engine = SCRIPTS / "failing_engine.py"
    proc = ServerProcess([f"out=pytok:{engine}", "--model-path", str(tiny_model)], log_dir=tmp_path)
    try:
        proc.wait_ready()
        client = anthropic.Anthropic(base_url=proc.base_url, api_key="x", max_retries=0, timeout=30)
        messages = [{"role": "user", "content": QUESTION}]
        with (
            pytest.raises(anthropic.APIStatusError, match="the engine broke down"),
            client.messages.stream(model=tiny_model.name, max_tokens=50, messages=messages) as stream,
        ):
            for _ in stream:
                pass
        with pytest.raises(anthropic.InternalServerError) as caught:
            client.messages.create(model=tiny_model.name, max_tokens=50, messages=messages)
        assert caught.value.body["error"]["type"] == "api_error"
    finally:
        proc.stop()

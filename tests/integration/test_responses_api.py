"""`POST /v1/responses` through the official `openai` client's `responses.create`.

Against `out=echo_core` (the answer is the templated prompt, so the conversion of `input` and
`instructions` into the chat template is checked exactly) and against agent_engine.py with the
hermes tool-call parser and the qwen3 reasoning parser, for a function-tool round trip.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.http_streams import abandon_stream, cancelled_streams, paced_server
from tests.support.metrics import metric
from tests.support.processes import ServerProcess
from tests.support.scripts import SCRIPTS

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
        "type": "function",
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
CITY = "Funafuti"


@pytest.fixture(scope="module")
def echo(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, str]]:
    proc = ServerProcess(
        ["out=echo_core", "--model-path", str(tiny_model)], log_dir=tmp_path_factory.mktemp("logs")
    )
    try:
        proc.wait_ready()
        yield (
            openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="x", max_retries=0, timeout=30),
            tiny_model.name,
        )
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def agent(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, str]]:
    args = [f"out=pytok:{ENGINE}", "--model-path", str(tiny_model), "--dyn-tool-call-parser", "hermes"]
    args += ["--dyn-reasoning-parser", "qwen3"]
    env = {"AGENT_FORMAT": "hermes", "AGENT_THINK": "qwen3"}
    proc = ServerProcess(args, env=env, log_dir=tmp_path_factory.mktemp("logs"))
    try:
        proc.wait_ready()
        yield (
            openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="x", max_retries=0, timeout=30),
            tiny_model.name,
        )
    finally:
        assert proc.stop() == 0, proc.log()


def test_plain(echo: tuple[openai.OpenAI, str]) -> None:
    client, model = echo
    resp = client.responses.create(model=model, instructions="Answer briefly.", input=QUESTION)
    assert resp.status == "completed" and resp.object == "response" and resp.id.startswith("resp_")
    # echo_core stops at the template's own end of turn after the system header.
    assert resp.output_text == TEMPLATED.split("<|eot_id|>")[0]
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert resp.usage.input_tokens > 20 and resp.usage.output_tokens > 5
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.store is False


def test_input_items_become_the_template(echo: tuple[openai.OpenAI, str]) -> None:
    client, model = echo
    items = [
        {"role": "system", "content": "Answer briefly."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    ]
    resp = client.responses.create(model=model, input=items, extra_body={"nvext": {"ignore_eos": True}})
    assert resp.output_text == TEMPLATED


def test_streamed_events_in_order(echo: tuple[openai.OpenAI, str]) -> None:
    client, model = echo
    events = list(
        client.responses.create(model=model, instructions="Answer briefly.", input=QUESTION, stream=True)
    )
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 5
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == TEMPLATED.split("<|eot_id|>")[0]
    done = events[-1].response
    assert done.status == "completed" and done.output_text == text and done.usage.output_tokens > 5
    assert events[0].response.id == done.id and events[2].item.id == done.output[0].id


def test_max_output_tokens_is_incomplete(echo: tuple[openai.OpenAI, str]) -> None:
    client, model = echo
    resp = client.responses.create(model=model, input=QUESTION, max_output_tokens=3)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3
    events = list(client.responses.create(model=model, input=QUESTION, max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "temperature": 9}, "temperature"),
        ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),  # past the context
        ({}, "input"),
    ],
)
def test_bad_input_names_the_field(echo: tuple[openai.OpenAI, str], body: dict, param: str) -> None:
    client, model = echo
    reply = httpx.post(f"{client.base_url}responses", json={"model": model, **body}, timeout=10)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"]


def test_function_tool_round_trip(agent: tuple[openai.OpenAI, str]) -> None:
    client, model = agent
    first = client.responses.create(model=model, input=CITY, tools=TOOLS)
    kinds = [item.type for item in first.output]
    assert kinds == ["reasoning", "message", "function_call"], kinds
    assert "characters of help" in first.output[0].content[0].text
    assert first.output[1].content[0].text == "Let me look that up.\n"
    call = first.output[2]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": CITY}
    assert call.call_id.startswith("call_")

    history = [
        {"role": "user", "content": CITY},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 31 C"},
    ]
    final = client.responses.create(model=model, input=history, tools=TOOLS)
    assert final.status == "completed"
    assert final.output_text == "The tool says: sunny, 31 C"
    assert [item.type for item in final.output] == ["reasoning", "message"]


def test_function_tool_streamed(agent: tuple[openai.OpenAI, str]) -> None:
    client, model = agent
    events = list(client.responses.create(model=model, input=CITY, tools=TOOLS, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.reasoning_text.delta" in kinds
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(arguments) == {"city": CITY}
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]


def test_client_disconnect_cancels_generation(tiny_model: Path, tmp_path: Path) -> None:
    """A slow stream abandoned after its first delta is cancelled, not run to the end."""
    proc = paced_server(tiny_model, tmp_path, 100)
    try:
        body = {"model": tiny_model.name, "input": QUESTION, "stream": True, "nvext": {"ignore_eos": True}}
        abandon_stream(proc, "/v1/responses", body, "output_text.delta")
        assert cancelled_streams(proc, "responses", tiny_model.name) == 1
        assert metric(proc, "dynamo_frontend_inflight_requests") == 0
    finally:
        proc.stop()


def test_stream_helper_accumulates(agent: tuple[openai.OpenAI, str]) -> None:
    """The SDK's `responses.stream` helper rebuilds the response from the events alone."""
    client, model = agent
    with client.responses.stream(model=model, input=CITY, tools=TOOLS) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Let me look that up.\n"
    assert json.loads(final.output[2].arguments) == {"city": CITY}


def test_stored_responses_are_not_kept(echo: tuple[openai.OpenAI, str]) -> None:
    client, model = echo
    resp = client.responses.create(model=model, input=QUESTION, store=True)
    assert resp.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_failure_mid_stream(tiny_model: Path, tmp_path: Path) -> None:
    """An engine failure after the stream began: OpenAI's `error` event, then `response.failed`."""
    engine = SCRIPTS / "failing_engine.py"
    proc = ServerProcess([f"out=pytok:{engine}", "--model-path", str(tiny_model)], log_dir=tmp_path)
    try:
        proc.wait_ready()
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="x", max_retries=0, timeout=30)
        events = list(client.responses.create(model=tiny_model.name, input=QUESTION, stream=True))
        assert [e.type for e in events[-2:]] == ["error", "response.failed"]
        assert "the engine broke down" in events[-2].message
        assert events[-1].response.status == "failed"
        with pytest.raises(openai.InternalServerError, match="the engine broke down"):
            client.responses.create(model=tiny_model.name, input=QUESTION)
    finally:
        proc.stop()

"""Tool calls and reasoning through the HTTP frontend, with the official `openai` client.

The engine is tests/support/scripts/agent_engine.py (a pytok file): it reads the real prompt
(the tiny model's chat template) and answers in one tool-call format, a token a chunk, so the
frontend's parsers see the markup split wherever the tokenizer splits it. Each server runs one
format, with or without a thinking section, and the test does an agent's round trip: tools ->
tool_calls -> a `tool` message -> the answer, streamed and not.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from dynamo_graph.llm.reasoning import REASONING_PARSERS
from dynamo_graph.llm.tool_calls import TOOL_CALL_PARSERS
from tests.support.processes import ServerProcess, WorkerProcess, embedded_planes_env, run_cli, running_server
from tests.support.scripts import SCRIPTS

ENGINE = SCRIPTS / "agent_engine.py"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CITY = "Funafuti"
MARKUP = ["tool_call", "python_tag", "TOOL_CALLS", "get_weather", "｜", "think>", "```", '{"']
# (tool-call format, reasoning parser): every format alone, and two with thinking first.
SERVERS = [(name, None) for name in TOOL_CALL_PARSERS] + [("hermes", "qwen3"), ("deepseek_v3", "deepseek_r1")]


@pytest.fixture(scope="module", params=SERVERS, ids=[f"{t}+{r}" if r else t for t, r in SERVERS])
def agent(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[openai.OpenAI, str, str | None]]:
    fmt, think = request.param
    args = [f"out=pytok:{ENGINE}", "--model-path", str(tiny_model), "--dyn-tool-call-parser", fmt]
    env = {"AGENT_FORMAT": fmt}
    if think:
        args += ["--dyn-reasoning-parser", think]
        env["AGENT_THINK"] = think
    proc = ServerProcess(args, env=env, log_dir=tmp_path_factory.mktemp("logs"))
    try:
        proc.wait_ready()
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="x", max_retries=0, timeout=30)
        yield client, tiny_model.name, think
    finally:
        assert proc.stop() == 0, proc.log()


def no_markup(text: str | None) -> bool:
    return not text or not any(m in text for m in MARKUP)


def test_round_trip_not_streamed(agent: tuple[openai.OpenAI, str, str | None]) -> None:
    client, model, think = agent
    messages: list[dict] = [{"role": "user", "content": CITY}]
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert no_markup(message.content)
    assert message.content in (None, "Let me look that up.\n")
    (call,) = message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": CITY}
    reasoning = getattr(message, "reasoning_content", None)
    assert (reasoning is not None and "characters of help" in reasoning) == bool(think)
    assert first.usage is not None and first.usage.completion_tokens > 10

    messages += [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 31 C"},
    ]
    final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.content == "The tool says: sunny, 31 C"
    assert not final.choices[0].message.tool_calls


def test_round_trip_streamed(agent: tuple[openai.OpenAI, str, str | None]) -> None:
    client, model, think = agent
    messages: list[dict] = [{"role": "user", "content": CITY}]
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert all(no_markup(d.content) for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert calls[0].id and calls[0].function.name == "get_weather" and not calls[0].function.arguments
    assert all(tc.index == 0 and tc.id is None and tc.function.name is None for tc in calls[1:])
    arguments = "".join(tc.function.arguments or "" for tc in calls)
    assert json.loads(arguments) == {"city": CITY}
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert ("characters of help" in reasoning) == bool(think)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "tool_calls"
    ]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 10

    messages += [
        {
            "role": "assistant",
            "content": "".join(d.content or "" for d in deltas) or None,
            "tool_calls": [
                {
                    "id": calls[0].id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].id, "content": "rain"},
    ]
    final = list(client.chat.completions.create(model=model, messages=messages, tools=TOOLS, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in final if c.choices) == "The tool says: rain"
    assert final[-1].choices[0].finish_reason == "stop"


def test_usage_counts_every_token(agent: tuple[openai.OpenAI, str, str | None]) -> None:
    """Parsing sorts text; it never changes the token counts."""
    client, model, _ = agent
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": CITY}],
        tools=TOOLS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    messages = [{"role": "user", "content": CITY}]
    whole = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens  # type: ignore[union-attr]


def test_tool_choice_that_needs_guided_decoding_is_a_400(
    agent: tuple[openai.OpenAI, str, str | None],
) -> None:
    client, model, _ = agent
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": CITY}], tools=TOOLS, tool_choice=choice
            )
        assert exc.value.body["param"] == "tool_choice"  # type: ignore[index]


def test_tool_choice_none_leaves_the_text_alone(agent: tuple[openai.OpenAI, str, str | None]) -> None:
    client, model, _ = agent
    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": CITY}], tools=TOOLS, tool_choice="none"
    )
    assert resp.choices[0].finish_reason == "stop" and not resp.choices[0].message.tool_calls
    assert CITY in (resp.choices[0].message.content or "")


@pytest.fixture(scope="module")
def plain_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """No parsers: the model's text is all content, and tool_choice "auto" has nothing to act on."""
    proc = ServerProcess(
        [f"out=pytok:{ENGINE}", "--model-path", str(tiny_model)],
        env={"AGENT_FORMAT": "hermes"},
        log_dir=tmp_path_factory.mktemp("logs"),
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


def test_without_a_parser_calls_stay_content_and_auto_is_a_400(
    plain_server: ServerProcess, tiny_model: Path
) -> None:
    body = {"model": tiny_model.name, "messages": [{"role": "user", "content": CITY}], "tools": TOOLS}
    resp = httpx.post(f"{plain_server.base_url}/v1/chat/completions", json=body, timeout=30)
    message = resp.json()["choices"][0]["message"]
    assert "<tool_call>" in message["content"] and "tool_calls" not in message
    url = f"{plain_server.base_url}/v1/chat/completions"
    resp = httpx.post(url, json={**body, "tool_choice": "auto"}, timeout=30)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "tool_choice"
    assert "--dyn-tool-call-parser" in resp.json()["error"]["message"]


def test_unknown_parser_names_are_cli_errors(tiny_model: Path) -> None:
    flags = (("--dyn-tool-call-parser", TOOL_CALL_PARSERS), ("--dyn-reasoning-parser", REASONING_PARSERS))
    for flag, valid in flags:
        result = run_cli(["run", "in=http", "out=echo_core", "--model-path", str(tiny_model), flag, "nope"])
        assert result.returncode == 2
        assert f"{flag}: unknown parser 'nope'; valid names: {', '.join(valid)}" in result.stderr


def test_a_separate_frontend_reads_the_parser_from_the_card(tiny_model: Path, tmp_path: Path) -> None:
    """The worker names the parsers; a frontend started without them parses as the card says."""
    planes = embedded_planes_env(tmp_path)
    worker = WorkerProcess.dyngraph(
        [
            "in=dyn://agents.backend.generate",
            f"out=pytok:{ENGINE}",
            "--model-path",
            str(tiny_model),
            "--dyn-tool-call-parser",
            "mistral",
            "--dyn-reasoning-parser",
            "deepseek_r1",
        ],
        env={**planes, "AGENT_FORMAT": "mistral", "AGENT_THINK": "deepseek_r1"},
        log_dir=tmp_path,
    )
    try:
        with running_server(["out=auto"], env=planes, log_dir=tmp_path) as front:
            client = openai.OpenAI(base_url=f"{front.base_url}/v1", api_key="x", max_retries=0, timeout=30)
            deadline = time.monotonic() + 30
            while not list(client.models.list()) and time.monotonic() < deadline:
                time.sleep(0.1)
            resp = client.chat.completions.create(
                model=tiny_model.name, messages=[{"role": "user", "content": CITY}], tools=TOOLS
            )
            message = resp.choices[0].message
            assert resp.choices[0].finish_reason == "tool_calls"
            assert json.loads(message.tool_calls[0].function.arguments) == {"city": CITY}  # type: ignore[index]
            assert "characters of help" in getattr(message, "reasoning_content", "")
    finally:
        assert worker.stop() == 0, worker.log()

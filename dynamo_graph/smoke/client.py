"""The smoke checks' HTTP side: send one chat or completion request, as a client sees it.

An `Answer` is what came back whatever the API: the text (or the error message), the finish
reason, usage, the tool calls' function names, time to the first token and to the end. A stream
is read as an SDK reads it — `data:` events up to `[DONE]` — and asks for usage in its last
chunk (`stream_options.include_usage`); an error event, a missing `[DONE]` or a stream without a
finish reason is recorded as a protocol problem, which fails the check whatever it expects.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from dynamo_graph.graph.schema import SmokeChat, SmokeCompletion


@dataclass
class Answer:
    status: int = 0
    text: str = ""  # the content, or an error response's message
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    tool_calls: list[str] = field(default_factory=list)  # function names, in order
    ttft_s: float | None = None
    latency_s: float = 0.0
    problems: list[str] = field(default_factory=list)  # broken protocol: fails any check


def request_body(request: SmokeChat | SmokeCompletion, model: str) -> dict[str, Any]:
    """The OpenAI request body of a check."""
    body: dict[str, Any] = {"model": request.model or model, "max_tokens": request.max_tokens}
    if isinstance(request, SmokeChat):
        body["messages"] = request.messages or [{"role": "user", "content": request.prompt}]
        for key in ("tools", "tool_choice"):
            if (value := getattr(request, key)) is not None:
                body[key] = value
    else:
        body["prompt"] = request.prompt
    for key in ("temperature", "seed", "stop"):
        if (value := getattr(request, key)) is not None:
            body[key] = value
    if request.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return {**body, **request.extra}


def _path(request: SmokeChat | SmokeCompletion) -> str:
    return "/v1/chat/completions" if isinstance(request, SmokeChat) else "/v1/completions"


async def send(
    client: httpx.AsyncClient,
    base_url: str,
    request: SmokeChat | SmokeCompletion,
    model: str,
    headers: dict[str, str] | None = None,
) -> Answer:
    """Send the request; raises httpx errors (connection, timeout) to the caller."""
    body = request_body(request, model)
    answer = Answer()
    started = time.perf_counter()
    async with client.stream("POST", base_url + _path(request), json=body, headers=headers) as response:
        answer.status = response.status_code
        if response.status_code != 200 or not body.get("stream"):
            raw = await response.aread()
            answer.latency_s = time.perf_counter() - started
            _read_body(answer, raw, isinstance(request, SmokeChat))
            return answer
        await _read_stream(answer, response, started, isinstance(request, SmokeChat))
    answer.latency_s = time.perf_counter() - started
    return answer


def _read_body(answer: Answer, raw: bytes, chat: bool) -> None:
    try:
        data = json.loads(raw)
    except ValueError:
        answer.problems.append(f"the body is not JSON: {raw[:200]!r}")
        return
    if answer.status != 200:
        error = data.get("error") if isinstance(data, dict) else None
        if not isinstance(error, dict) or "message" not in error:
            answer.problems.append(f"an error response without an OpenAI error body: {raw[:200]!r}")
        else:
            answer.text = str(error["message"])
        return
    choice = (data.get("choices") or [{}])[0]
    message = (choice.get("message") or {}) if chat else choice
    answer.text = (message.get("content") if chat else message.get("text")) or ""
    answer.finish_reason = choice.get("finish_reason")
    answer.tool_calls = [c["function"]["name"] for c in message.get("tool_calls") or []] if chat else []
    _usage(answer, data.get("usage"))


def _usage(answer: Answer, usage: Any) -> None:
    if isinstance(usage, dict):
        answer.prompt_tokens = usage.get("prompt_tokens")
        answer.completion_tokens = usage.get("completion_tokens")


async def _read_stream(answer: Answer, response: httpx.Response, started: float, chat: bool) -> None:
    done = False
    parts: list[str] = []
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            done = True
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            error = chunk["error"]
            answer.problems.append(
                f"error event: {error.get('message', error) if isinstance(error, dict) else error}"
            )
            continue
        _usage(answer, chunk.get("usage"))
        for choice in chunk.get("choices") or []:
            delta = (choice.get("delta") or {}) if chat else choice
            text = (delta.get("content") if chat else delta.get("text")) or ""
            calls = (delta.get("tool_calls") or []) if chat else []
            if (text or calls) and answer.ttft_s is None:
                answer.ttft_s = time.perf_counter() - started
            parts.append(text)
            answer.tool_calls += [
                c["function"]["name"] for c in calls if (c.get("function") or {}).get("name")
            ]
            answer.finish_reason = choice.get("finish_reason") or answer.finish_reason
    answer.text = "".join(parts)
    if not done:
        answer.problems.append("the stream ended without `data: [DONE]`")
    elif answer.finish_reason is None and not answer.problems:
        answer.problems.append("no chunk of the stream carried a finish_reason")

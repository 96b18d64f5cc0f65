"""A Responses request as the chat completion the pipeline runs.

Stateless: `previous_response_id`, `conversation` and `background` need stored responses, which
this frontend does not keep, so they are a 400 naming the field. `store` (which the SDK leaves
unset and OpenAI defaults to true) is accepted; every response says `"store": false`, and
`GET /v1/responses/{id}` finds nothing.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from dynamo_graph.frontend.api_surface import SurfaceHandler
from dynamo_graph.frontend.errors import HTTPError, request_decoder
from dynamo_graph.frontend.openai_responses.events import ResponseEvents
from dynamo_graph.frontend.openai_responses.protocol import NamedFunction, ResponsesRequest
from dynamo_graph.llm.openai import ChatCompletionRequest, ChatMessage
from dynamo_graph.llm.pipeline import Prepared

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


def _bad(message: str, param: str) -> HTTPError:
    return HTTPError(400, message, param=param, code="invalid_request")


def _text(content: Any, where: str) -> str:
    """A message's or tool output's text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"`{where}` must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _bad(
                f"`{where}[{j}]`: only text parts (input_text, output_text) are supported, not {kind!r}",
                f"{where}[{j}].type",
            )
        texts.append(part["text"])
    return "".join(texts)


def _messages(items: str | list[dict[str, Any]]) -> list[ChatMessage]:
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    messages: list[ChatMessage] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _bad(f"`{where}.role` must be one of {', '.join(_ROLES)}", f"{where}.role")
            messages.append(ChatMessage(role=role, content=_text(item.get("content"), f"{where}.content")))
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            for field, value in (("call_id", call_id), ("name", name), ("arguments", arguments)):
                if not isinstance(value, str):
                    raise _bad(f"`{where}.{field}` must be a string", f"{where}.{field}")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise _bad(f"`{where}.call_id` must be a string", f"{where}.call_id")
            output = _text(item.get("output"), f"{where}.output")
            messages.append(ChatMessage(role="tool", content=output, tool_call_id=call_id))
        elif kind != "reasoning":  # earlier reasoning: chat templates leave it out too
            raise _bad(f"`{where}.type` {kind!r} is not supported", f"{where}.type")
    return messages


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool (flat) as a chat tool's `function`."""
    return {k: v for k, v in tool.items() if k != "type" and v is not None}


def to_chat(request: ResponsesRequest) -> ChatCompletionRequest:
    for field in ("previous_response_id", "conversation"):
        if getattr(request, field) is not None:
            raise _bad(
                f"`{field}` needs stored responses, and this server keeps none: send the whole "
                "conversation in `input`",
                field,
            )
    if request.background:
        raise _bad("`background` responses are not supported", "background")
    messages = _messages(request.input)
    if request.instructions is not None:
        messages.insert(0, ChatMessage(role="system", content=request.instructions))
    tools = None
    if request.tools:
        tools = [
            {"type": "function", "function": _function(msgspec.structs.asdict(tool))}
            for tool in request.tools
        ]
    choice: Any = request.tool_choice
    if isinstance(choice, NamedFunction):
        choice = {"type": "function", "function": {"name": choice.name}}
    response_format = None
    fmt = request.text.format if request.text is not None else None
    if fmt is not None and fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        response_format = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None and fmt.get("type") == "json_object":
        response_format = {"type": "json_object"}
    return ChatCompletionRequest(
        model=request.model,
        messages=messages,
        stream=request.stream,
        max_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=request.parallel_tool_calls,
        response_format=response_format,
        user=request.user,
        nvext=request.nvext,
    )


class ResponsesHandler(SurfaceHandler):
    """`POST /v1/responses`."""

    endpoint = "responses"

    decoder = request_decoder(ResponsesRequest)
    param_names: ClassVar[dict[str, str]] = {
        "max_tokens": "max_output_tokens",
        "messages": "input",
        "response_format": "text.format",
    }

    def convert(self, request: ResponsesRequest) -> ChatCompletionRequest:
        return to_chat(request)

    def writer(self, request: ResponsesRequest, prepared: Prepared) -> ResponseEvents:
        return ResponseEvents(request, prepared)

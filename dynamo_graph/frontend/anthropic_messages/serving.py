"""A Messages request as the chat completion the pipeline runs, and the two routes.

`tool_use` blocks become the assistant message's `tool_calls` (arguments as JSON text) and
`tool_result` blocks become `tool` messages, placed before the user's text of the same turn, as
the chat templates expect a call's result right after the call. Thinking blocks of earlier turns
are dropped, as chat templates drop earlier reasoning. Images are a 400: no engine here sees them.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from dynamo_graph.frontend.anthropic_messages.events import MessageEvents, error_object
from dynamo_graph.frontend.anthropic_messages.protocol import (
    CountTokensRequest,
    ImageBlock,
    MessagesRequest,
    TextBlock,
    Tool,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from dynamo_graph.frontend.api_surface import SurfaceHandler
from dynamo_graph.frontend.errors import HTTPError, request_decoder
from dynamo_graph.frontend.openai_asgi import Receive, Send, send_json
from dynamo_graph.frontend.tenant_limits import TenantRequest
from dynamo_graph.llm.openai import ChatCompletionRequest, ChatMessage
from dynamo_graph.llm.pipeline import ModelPipeline, Prepared
from dynamo_graph.llm.preprocessor import UNSUPPORTED_BY_MODEL
from dynamo_graph.runtime.context import Context


def _bad(message: str, param: str) -> HTTPError:
    return HTTPError(400, message, param=param, code="invalid_request")


def _texts(content: str | list[Any], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        if isinstance(block, ImageBlock):
            raise _bad(f"`{where}[{j}]`: image blocks are not supported", f"{where}[{j}].type")
        texts.append(block.text)
    return "".join(texts)


def _turn(role: str, blocks: list[Any], i: int) -> list[ChatMessage]:
    """One Messages turn as chat messages: its tool results first, then its text and calls."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[ChatMessage] = []
    for j, block in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ImageBlock):
            raise _bad(f"`{where}`: image blocks are not supported", f"{where}.type")
        elif isinstance(block, ToolUseBlock):
            if role != "assistant":
                raise _bad(f"`{where}`: tool_use blocks belong in assistant messages", f"{where}.type")
            arguments = msgspec.json.encode(block.input).decode()
            calls.append(
                {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}
            )
        elif isinstance(block, ToolResultBlock):
            if role != "user":
                raise _bad(f"`{where}`: tool_result blocks belong in user messages", f"{where}.type")
            output = _texts(block.content, f"{where}.content")
            results.append(ChatMessage(role="tool", content=output, tool_call_id=block.tool_use_id))
    if texts or calls:
        content = "".join(texts) if texts else None
        results.append(ChatMessage(role=role, content=content, tool_calls=calls or None))  # type: ignore[arg-type]
    return results


def _function(tool: Tool) -> dict[str, Any]:
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return function


def to_chat(request: CountTokensRequest) -> ChatCompletionRequest:
    messages: list[ChatMessage] = []
    if request.system is not None:
        messages.append(ChatMessage(role="system", content=_texts(request.system, "system")))
    for i, message in enumerate(request.messages):
        if isinstance(message.content, str):
            messages.append(ChatMessage(role=message.role, content=message.content))
        else:
            messages += _turn(message.role, message.content, i)
    tools = None
    if request.tools:
        tools = [{"type": "function", "function": _function(tool)} for tool in request.tools]
    choice: Any = None
    parallel = None
    tc = request.tool_choice
    if tc is not None:
        if isinstance(tc, ToolChoiceNone):
            choice = "none"
        else:
            choice = "required" if isinstance(tc, ToolChoiceAny) else "auto"
            if isinstance(tc, ToolChoiceTool):
                choice = {"type": "function", "function": {"name": tc.name}}
            parallel = False if tc.disable_parallel_tool_use else None
    sampling: dict[str, Any] = {}
    if isinstance(request, MessagesRequest):
        sampling = {
            "stream": request.stream,
            "max_tokens": request.max_tokens,
            "stop": request.stop_sequences,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "nvext": request.nvext,
        }
    return ChatCompletionRequest(
        model=request.model,
        messages=messages,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        **sampling,
    )


class MessagesHandler(SurfaceHandler):
    """`POST /v1/messages`."""

    endpoint = "messages"
    decoder = request_decoder(MessagesRequest)
    param_names: ClassVar[dict[str, str]] = {"stop": "stop_sequences"}

    def convert(self, request: CountTokensRequest) -> ChatCompletionRequest:
        return to_chat(request)

    def render_error(self, err: HTTPError) -> bytes:
        return msgspec.json.encode(error_object(err))

    def writer(self, request: MessagesRequest, prepared: Prepared) -> MessageEvents:
        return MessageEvents(request, prepared)


class CountTokensHandler(MessagesHandler):
    """`POST /v1/messages/count_tokens`: the prompt the model's template makes, counted; nothing
    is generated."""

    decoder = request_decoder(CountTokensRequest)

    async def _serve(
        self,
        pipeline: ModelPipeline,
        prepared: Prepared,
        request: Any,
        receive: Receive,
        send: Send,
        deadline: float | None = None,
        retry: bool = False,
        tenant: TenantRequest | None = None,
        root: Context | None = None,
    ) -> None:
        if prepared.preprocessed is None:
            err = HTTPError(
                400,
                f"Model {pipeline.name!r} is served by an engine that applies its own template; "
                "its prompt cannot be counted here",
                param="model",
                code=UNSUPPORTED_BY_MODEL,
            )
            await send_json(send, 400, self.error_body(err))
            return
        await send_json(send, 200, msgspec.json.encode({"input_tokens": prepared.prompt_tokens}))
        if tenant is not None:
            tenant.ended("success", prepared.prompt_tokens, 0)

"""A message's content blocks and server-sent events, in the order Anthropic's SDK parses them,
and errors in Anthropic's shape.

The pipeline's deltas each carry one kind of output (chat_output.py), in the order the model
wrote it; a change of kind, or a new tool call, closes the open block and opens the next:
`thinking`, `text` or `tool_use` (whose arguments stream as `input_json_delta`). The per-token
text delta is built from a prefix made when its block opens (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import msgspec

from dynamo_graph.frontend.anthropic_messages.protocol import MessagesRequest
from dynamo_graph.frontend.errors import ErrorSchema, HTTPError
from dynamo_graph.llm.chat_output import Delta
from dynamo_graph.llm.pipeline import Prepared
from dynamo_graph.runtime.context import unique_hex

_encode = msgspec.json.encode
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
# The pipeline's finish reason -> Anthropic's stop_reason ("stop" may be a stop sequence).
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def error_object(err: HTTPError) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`; the message names the field, as
    Anthropic's body has no separate `param`."""
    kind = _ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    message = err.message
    if err.param and f"`{err.param}`" not in message:
        message = f"{message} (field `{err.param}`)"
    return {"type": "error", "error": {"type": kind, "message": message}}


ANTHROPIC_ERROR = ErrorSchema(
    "AnthropicError",
    {
        "type": "object",
        "properties": {
            "type": {"const": "error"},
            "error": {
                "type": "object",
                "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
                "required": ["type", "message"],
            },
        },
        "required": ["type", "error"],
    },
)


class MessageEvents:
    """One request's output: the events to stream, and the message they build."""

    __slots__ = ("_block", "_kind", "_message", "_parts", "_prepared", "_stream", "_text_head", "content")

    def __init__(self, request: MessagesRequest, prepared: Prepared) -> None:
        self._prepared = prepared
        self._stream = request.stream
        self._kind: str | None = None  # of the open block: "text", "thinking", "tool_use"
        self._block: dict[str, Any] = {}
        self._parts: list[str] = []  # the open block's text (or input JSON) so far
        self._text_head = b""
        self.content: list[dict[str, Any]] = []
        self._message: dict[str, Any] = {
            "id": "msg_" + unique_hex(),
            "type": "message",
            "role": "assistant",
            "model": request.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prepared.prompt_tokens, "output_tokens": 0},
        }

    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        if not self._stream:
            return b""
        return b"event: " + kind.encode() + b"\ndata: " + _encode({"type": kind, **fields}) + b"\n\n"

    def start(self) -> bytes:
        return self._event("message_start", {"message": self._message})

    def delta(self, delta: Delta) -> bytes:
        if delta.text:
            out = b"" if self._kind == "text" else self._open({"type": "text", "text": ""})
            self._parts.append(delta.text)
            return out + self._text_head + _encode(delta.text) + b"}}\n\n" if self._stream else out
        index = len(self.content)
        if delta.reasoning:
            out = (
                b""
                if self._kind == "thinking"
                else self._open({"type": "thinking", "thinking": "", "signature": ""})
            )
            self._parts.append(delta.reasoning)
            return out + self._event(
                "content_block_delta",
                {"index": index, "delta": {"type": "thinking_delta", "thinking": delta.reasoning}},
            )
        call = delta.tool_call
        if call is None:  # logprobs alone: the Messages API has none
            return b""
        out = b""
        if call.id is not None:
            out = self._open({"type": "tool_use", "id": call.id, "name": call.name or "", "input": {}})
        if not call.arguments:
            return out
        self._parts.append(call.arguments)
        return out + self._event(
            "content_block_delta",
            {
                "index": len(self.content),
                "delta": {"type": "input_json_delta", "partial_json": call.arguments},
            },
        )

    def _open(self, block: dict[str, Any]) -> bytes:
        out = self._close()
        index = len(self.content)
        self._kind, self._block, self._parts = block["type"], block, []
        if block["type"] == "text":
            self._text_head = (
                b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,'
                b'"delta":{"type":"text_delta","text":' % index
            )
        return out + self._event("content_block_start", {"index": index, "content_block": block})

    def _close(self) -> bytes:
        """Closes the open block, if any: its stop event, and the block joins the content."""
        kind = self._kind
        if kind is None:
            return b""
        index, text = len(self.content), "".join(self._parts)
        self._kind = None
        if kind == "tool_use":
            try:
                arguments = msgspec.json.decode(text or "{}")
            except msgspec.DecodeError:
                arguments = None
            block = {**self._block, "input": arguments if isinstance(arguments, dict) else {}}
        else:
            block = {**self._block, kind: text}
        self.content.append(block)
        return self._event("content_block_stop", {"index": index})

    def finish(self, reason: str) -> bytes:
        out = self._close()
        prepared = self._prepared
        message = self._message
        stop_sequence = prepared.stop_string if reason == "stop" else None
        message["stop_reason"] = "stop_sequence" if stop_sequence else _STOP_REASONS.get(reason, "end_turn")
        message["stop_sequence"] = stop_sequence
        message["usage"] = {
            "input_tokens": prepared.prompt_tokens,
            "output_tokens": prepared.completion_tokens,
        }
        delta = {"stop_reason": message["stop_reason"], "stop_sequence": stop_sequence}
        out += self._event(
            "message_delta", {"delta": delta, "usage": {"output_tokens": prepared.completion_tokens}}
        )
        return out + self._event("message_stop", {})

    def failure(self, err: HTTPError) -> bytes:
        """Anthropic's `error` event: the SDK raises it."""
        return b"event: error\ndata: " + _encode(error_object(err)) + b"\n\n"

    def body(self) -> bytes:
        return _encode({**self._message, "content": self.content})

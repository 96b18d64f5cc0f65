"""A response's output items and its server-sent events, in the order OpenAI's SDK parses them.

The pipeline's deltas each carry one kind of output (chat_output.py), in the order the model
wrote it; a change of kind, or a new tool call, closes the open item and opens the next:
`reasoning` (reasoning_text parts), `message` (one output_text part) or `function_call`. Every
event has the next `sequence_number`. The per-token text delta is built from a prefix made when
its item opens, as the chat route's chunks are (openai_chat/events.py), to stay within the
frontend's CPU budget (docs/benchmarks.md).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from dynamo_graph.frontend.errors import HTTPError
from dynamo_graph.frontend.openai_responses.protocol import ResponsesRequest
from dynamo_graph.llm.chat_output import Delta
from dynamo_graph.llm.pipeline import Prepared
from dynamo_graph.runtime.context import unique_hex

_encode = msgspec.json.encode


def _id(prefix: str) -> str:
    return prefix + unique_hex()


class ResponseEvents:
    """One request's output: the events to stream, and the response object they build."""

    __slots__ = (
        "_delta_head",
        "_item",
        "_kind",
        "_parts",
        "_prepared",
        "_response",
        "_seq",
        "_stream",
        "output",
    )

    def __init__(self, request: ResponsesRequest, prepared: Prepared) -> None:
        self._prepared = prepared
        self._stream = request.stream
        self._seq = 0
        self._kind: str | None = None  # of the open item: "message", "reasoning", "function_call"
        self._item: dict[str, Any] = {}
        self._parts: list[str] = []  # the open item's text (or arguments) so far
        self._delta_head = b""
        self.output: list[dict[str, Any]] = []
        tools = [msgspec.structs.asdict(t) for t in request.tools or ()]
        choice = request.tool_choice
        self._response: dict[str, Any] = {
            "id": _id("resp_"),
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": request.model,
            "output": [],
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": request.temperature,
            "text": {"format": (request.text.format if request.text else None) or {"type": "text"}},
            "tool_choice": choice if choice is not None else "auto",
            "tools": tools,
            "top_p": request.top_p,
            "truncation": "disabled",
            "usage": None,
            "metadata": request.metadata or {},
        }

    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        if not self._stream:
            return b""
        self._seq += 1
        data = _encode({"type": kind, "sequence_number": self._seq - 1, **fields})
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def _snapshot(self) -> dict[str, Any]:
        return {**self._response, "output": list(self.output)}

    def start(self) -> bytes:
        return self._event("response.created", {"response": self._snapshot()}) + self._event(
            "response.in_progress", {"response": self._snapshot()}
        )

    def delta(self, delta: Delta) -> bytes:
        if delta.text:
            out = b"" if self._kind == "message" else self._open("message")
            self._parts.append(delta.text)
            if not self._stream:
                return out
            self._seq += 1
            return (
                out + self._delta_head + _encode(delta.text) + b',"sequence_number":%d}\n\n' % (self._seq - 1)
            )
        if delta.reasoning:
            out = b"" if self._kind == "reasoning" else self._open("reasoning")
            self._parts.append(delta.reasoning)
            return out + self._event(
                "response.reasoning_text.delta",
                {
                    "item_id": self._item["id"],
                    "output_index": len(self.output),
                    "content_index": 0,
                    "delta": delta.reasoning,
                },
            )
        call = delta.tool_call
        if call is None:  # logprobs alone: the Responses API here does not report them
            return b""
        out = b""
        if call.id is not None:
            out = self._open("function_call", call_id=call.id, name=call.name or "")
        if not call.arguments:
            return out
        self._parts.append(call.arguments)
        return out + self._event(
            "response.function_call_arguments.delta",
            {"item_id": self._item["id"], "output_index": len(self.output), "delta": call.arguments},
        )

    def _open(self, kind: str, **fields: str) -> bytes:
        out = self._close()
        index = len(self.output)
        if kind == "message":
            item: dict[str, Any] = {
                "id": _id("msg_"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
        elif kind == "reasoning":
            item = {"id": _id("rs_"), "type": "reasoning", "summary": [], "content": []}
        else:
            item = {
                "id": _id("fc_"),
                "type": "function_call",
                "status": "in_progress",
                "arguments": "",
                **fields,
            }
        self._kind, self._item, self._parts = kind, item, []
        out += self._event("response.output_item.added", {"output_index": index, "item": item})
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._event(
                "response.content_part.added",
                {"item_id": item["id"], "output_index": index, "content_index": 0, "part": part},
            )
            self._delta_head = (
                b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","item_id":"'
                + item["id"].encode()
                + b'","output_index":%d,"content_index":0,"logprobs":[],"delta":' % index
            )
        return out

    def _close(self) -> bytes:
        """Closes the open item, if any: its done events, and the item joins the output."""
        kind = self._kind
        if kind is None:
            return b""
        item, index, text = self._item, len(self.output), "".join(self._parts)
        self._kind = None
        at = {"item_id": item["id"], "output_index": index}
        if kind == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out = self._event(
                "response.output_text.done", {**at, "content_index": 0, "text": text, "logprobs": []}
            )
            out += self._event("response.content_part.done", {**at, "content_index": 0, "part": part})
            item = {**item, "status": "completed", "content": [part]}
        elif kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            out = self._event("response.reasoning_text.done", {**at, "content_index": 0, "text": text})
            item = {**item, "content": [part]}
        else:
            out = self._event(
                "response.function_call_arguments.done", {**at, "name": item["name"], "arguments": text}
            )
            item = {**item, "status": "completed", "arguments": text}
        self.output.append(item)
        return out + self._event("response.output_item.done", {"output_index": index, "item": item})

    def finish(self, reason: str) -> bytes:
        out = self._close()
        prepared = self._prepared
        response = self._response
        if reason == "length":
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            response["status"] = "completed"
        response["usage"] = {
            "input_tokens": prepared.prompt_tokens,
            "input_tokens_details": {"cached_tokens": prepared.cached_tokens or 0},
            "output_tokens": prepared.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prepared.prompt_tokens + prepared.completion_tokens,
        }
        return out + self._event(f"response.{response['status']}", {"response": self._snapshot()})

    def failure(self, err: HTTPError) -> bytes:
        """OpenAI's `error` event, then `response.failed`."""
        out = self._event("error", {"code": err.code, "message": err.message, "param": err.param})
        self._response["status"] = "failed"
        self._response["error"] = {"code": str(err.code or "server_error"), "message": err.message}
        return out + self._event("response.failed", {"response": self._snapshot()})

    def body(self) -> bytes:
        return _encode(self._snapshot())

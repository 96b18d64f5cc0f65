"""Chat and completions answers: their SSE chunks (one writer: the chunks differ in a few bytes)
and their whole, non-streamed answer gathered from the same deltas. The bodies' JSON is the
packages' protocol.py (openai_chat/, openai_completions/).

Streamed chunks are assembled from a per-request prefix and a JSON-escaped delta instead of
encoding a dict per token: at 64 chunks per request this is the difference between fitting
the frontend's CPU budget and not (docs/benchmarks.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from dynamo_graph.frontend.openai_chat.protocol import usage_dict
from dynamo_graph.frontend.sse import DONE, error_event
from dynamo_graph.llm.logprobs import TokenLogprob, chat_logprobs, completion_logprobs
from dynamo_graph.llm.pipeline import Delta, Prepared
from dynamo_graph.llm.tool_calls import ToolCallDelta, merge_events
from dynamo_graph.runtime.context import unique_hex

if TYPE_CHECKING:
    from dynamo_graph.frontend.errors import HTTPError
    from dynamo_graph.llm.openai import AnyRequest

_encode = msgspec.json.encode


class ChunkWriter:
    """Formats one request's stream of chat or completion chunks as SSE events."""

    __slots__ = (
        "_chat",
        "_content_tail",
        "_finish_head",
        "_first",
        "_first_head",
        "_head",
        "_meta",
        "_prepared",
        "_start",
        "_text_offset",
        "_usage_head",
    )

    def __init__(self, model: str, *, chat: bool, prepared: Prepared | None = None) -> None:
        """`prepared`: the request whose usage the last chunk reports (include_usage), or None."""
        rid = ("chatcmpl-" if chat else "cmpl-") + unique_hex()
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._meta = b'"created":%d,"model":%s,"object":"%s"}' % (
            int(time.time()),
            _encode(model),
            obj.encode(),
        )
        start = b'data: {"id":"%s",' % rid.encode()
        self._start = start
        self._chat = chat
        self._first = True
        self._prepared = prepared
        self._text_offset = 0  # completions' logprobs.text_offset
        if chat:
            self._first_head = start + b'"choices":[{"index":0,"delta":{"role":"assistant","content":'
            self._head = start + b'"choices":[{"index":0,"delta":{"content":'
            self._content_tail = b'},"finish_reason":null,"logprobs":null}],' + self._meta + b"\n\n"
            self._finish_head = start + b'"choices":[{"index":0,"delta":{},"finish_reason":'
        else:
            self._first_head = self._head = start + b'"choices":[{"index":0,"text":'
            self._content_tail = b',"finish_reason":null,"logprobs":null}],' + self._meta + b"\n\n"
            self._finish_head = start + b'"choices":[{"index":0,"text":"","finish_reason":'
        self._usage_head = start + b'"choices":[],"usage":'

    def content(self, text: str, first: bool) -> bytes:
        head = self._first_head if first else self._head
        return head + _encode(text) + self._content_tail

    def start(self) -> bytes:
        return b""

    def delta(self, delta: Delta) -> bytes:
        """Any delta: content (with or without logprobs), reasoning, or a tool call."""
        first = self._first
        self._first = False
        if not delta.logprobs and delta.text:
            return self.content(delta.text, first)
        if not self._chat:
            choice = {"index": 0, "text": delta.text, "finish_reason": None, "logprobs": None}
            if delta.logprobs:
                choice["logprobs"] = completion_logprobs(delta.logprobs, self._text_offset)
                self._text_offset += sum(len(e.token) for e in delta.logprobs)
        else:
            fields: dict = {"role": "assistant"} if first else {}
            if delta.tool_call is not None:
                fields["tool_calls"] = [delta.tool_call.to_dict()]
            elif delta.reasoning:
                fields["reasoning_content"] = delta.reasoning
            else:
                fields["content"] = delta.text
            choice = {"index": 0, "delta": fields, "finish_reason": None, "logprobs": None}
            if delta.logprobs:
                choice["logprobs"] = chat_logprobs(delta.logprobs)
        return self._start + b'"choices":[' + _encode(choice) + b"]," + self._meta + b"\n\n"

    def finish(self, reason: str) -> bytes:
        tail = self._finish_head + _encode(reason) + b',"logprobs":null}],' + self._meta + b"\n\n"
        if self._prepared is not None:
            tail += self._usage_head + _encode(usage_dict(self._prepared)) + b"," + self._meta + b"\n\n"
        return tail + DONE

    def failure(self, err: HTTPError) -> bytes:
        return error_event(err)


def chunk_writer(request: AnyRequest, prepared: Prepared, *, chat: bool) -> ChunkWriter:
    """The writer of a chat or completions stream; the last chunk reports usage when the
    request's `stream_options.include_usage` asks for it."""
    opts = request.stream_options
    usage = opts is not None and opts.include_usage
    return ChunkWriter(request.model, chat=chat, prepared=prepared if usage else None)


# chat_completion_body's signature: (model, text, finish_reason, prepared, *, reasoning,
# tool_calls, logprobs) -> the whole answer's bytes.
BodyBuilder = Callable[..., bytes]


class WholeAnswer:
    """One request's deltas gathered into its whole chat completion or completion, for a request
    that does not stream; `build` renders it (chat_completion_body, or completions' own)."""

    __slots__ = ("_build", "_calls", "_finish", "_logprobs", "_model", "_prepared", "_reasoning", "_text")

    def __init__(self, model: str, prepared: Prepared, build: BodyBuilder) -> None:
        self._model = model
        self._prepared = prepared
        self._build = build
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[ToolCallDelta] = []
        pre = prepared.preprocessed
        wanted = pre is not None and pre.output_options.logprobs is not None
        self._logprobs: list[TokenLogprob] | None = [] if wanted else None
        self._finish = ""

    def delta(self, delta: Delta) -> None:
        if delta.logprobs and self._logprobs is not None:
            self._logprobs.extend(delta.logprobs)
        if delta.text:
            self._text.append(delta.text)
        elif delta.reasoning:
            self._reasoning.append(delta.reasoning)
        elif delta.tool_call is not None:
            self._calls.append(delta.tool_call)

    def finish(self, reason: str) -> None:
        self._finish = reason

    def body(self) -> bytes:
        return self._build(
            self._model,
            "".join(self._text),
            self._finish,
            self._prepared,
            reasoning="".join(self._reasoning),
            tool_calls=merge_events(self._calls).tool_calls,
            logprobs=self._logprobs,
        )

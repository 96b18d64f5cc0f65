"""Bytes of a token-in/token-out answer, in vLLM's shapes: a `GenerateTokensResponse`, or SSE
`GenerateTokensStreamResponse` chunks ending with `data: [DONE]`. Log-probabilities carry token
ids (`{"content": [{"token_id", "logprob", "top_logprobs": [{"token_id", "logprob"}]}]}`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec

from dynamo_graph.frontend.openai_chat.protocol import usage_dict
from dynamo_graph.frontend.sse import DONE, error_event
from dynamo_graph.llm.pipeline import Prepared
from dynamo_graph.llm.token_output import TokenDelta
from dynamo_graph.runtime.context import unique_hex

if TYPE_CHECKING:
    from dynamo_graph.frontend.errors import HTTPError

_encode = msgspec.json.encode


def _logprobs(delta: TokenDelta) -> list[dict[str, Any]]:
    tops = delta.top_logprobs or []
    return [
        {
            "token_id": token_id,
            "logprob": logprob,
            "top_logprobs": [{"token_id": t.token_id, "logprob": t.logprob} for t in tops[i]]
            if i < len(tops)
            else [],
        }
        for i, (token_id, logprob) in enumerate(zip(delta.token_ids, delta.log_probs or [], strict=False))
    ]


class TokensWriter:
    """One request's answer, streamed (`start`/`delta`/`finish`) or whole (`body`)."""

    def __init__(self, model: str, request_id: str | None, prepared: Prepared, *, usage: bool) -> None:
        self.model = model
        self.request_id = request_id or unique_hex()
        self.prepared = prepared
        self.usage = usage
        self.wants_logprobs = prepared.preprocessed is not None and (
            prepared.preprocessed.output_options.logprobs is not None
        )
        self.token_ids: list[int] = []
        self.logprobs: list[dict[str, Any]] = []
        self.stop_reason: int | None = None
        self.finish_reason: str | None = None
        self._head = b'data: {"request_id":' + _encode(self.request_id) + b',"choices":['

    def start(self) -> bytes:
        return b""

    def delta(self, delta: TokenDelta) -> bytes:
        self.token_ids.extend(delta.token_ids)
        self.stop_reason = delta.stop_reason
        choice: dict[str, Any] = {"index": 0, "token_ids": delta.token_ids, "finish_reason": None}
        if self.wants_logprobs:
            entries = _logprobs(delta)
            self.logprobs.extend(entries)
            choice["logprobs"] = {"content": entries}
        return self._head + _encode(choice) + b"]}\n\n"

    def finish(self, reason: str) -> bytes:
        self.finish_reason = reason
        choice = {"index": 0, "token_ids": [], "finish_reason": reason, "stop_reason": self.stop_reason}
        tail = self._head + _encode(choice) + b"]"
        if self.usage:
            tail += b',"usage":' + _encode(usage_dict(self.prepared))
        return tail + b"}\n\n" + DONE

    def failure(self, err: HTTPError) -> bytes:
        return error_event(err)

    def body(self) -> bytes:
        choice = {
            "index": 0,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "token_ids": self.token_ids,
            "logprobs": {"content": self.logprobs} if self.wants_logprobs else None,
        }
        return _encode(
            {
                "request_id": self.request_id,
                "model": self.model,
                "created": int(time.time()),
                "choices": [choice],
                "usage": usage_dict(self.prepared),
            }
        )

"""A stream interval: several tokens per SSE event (vLLM's and SGLang's `--stream-interval`).

Each SSE event costs the frontend a JSON chunk and the client a parse, whatever it carries; with
`--stream-interval N` a stream's first token goes out at once (the time to first token is
unchanged), then one event per N tokens, and whatever is held when the finish reason comes goes
out with it. Held deltas of one kind are merged into one (content with content and its
log-probabilities, reasoning with reasoning, token ids with token ids); a delta of another kind
(a tool call, reasoning after content) sends what is held first, so the order never changes.
"""

from __future__ import annotations

from typing import Any

from dynamo_graph.llm.chat_output import Delta
from dynamo_graph.llm.token_output import TokenDelta


def merged(held: Any, delta: Any) -> Any | None:
    """`held` then `delta` as one delta, or None when they do not merge (other kinds)."""
    if isinstance(held, Delta) and isinstance(delta, Delta):
        if held.tool_call is not None or delta.tool_call is not None:
            return None
        if bool(held.reasoning) != bool(delta.reasoning):
            return None
        return Delta(
            held.text + delta.text,
            reasoning=held.reasoning + delta.reasoning,
            logprobs=_joined(held.logprobs, delta.logprobs),
        )
    if isinstance(held, TokenDelta) and isinstance(delta, TokenDelta):
        return TokenDelta(
            held.token_ids + delta.token_ids,
            log_probs=_joined(held.log_probs, delta.log_probs),
            top_logprobs=_joined(held.top_logprobs, delta.top_logprobs),
            stop_reason=delta.stop_reason,
        )
    return None


def _joined(first: list | None, second: list | None) -> list | None:
    if first is None or second is None:
        return first if second is None else second
    return first + second


class StreamInterval:
    """One stream's visible deltas, let out every `every` tokens (`take`) and at the end (`rest`).
    Tokens are counted from the request's completion tokens where its pipeline keeps the count
    as it streams, else one per delta."""

    __slots__ = ("_count", "_every", "_held", "_sent_at", "_started")

    def __init__(self, every: int) -> None:
        self._every = every
        self._held: Any | None = None
        self._count = 0  # deltas held
        self._sent_at = 0  # completion tokens when an event last went out
        self._started = False

    def take(self, delta: Any, tokens: int) -> list[Any]:
        """What to send now, given a visible `delta` and the request's completion tokens so far."""
        out: list[Any] = []
        if self._held is None:
            self._held, self._count = delta, 1
        else:
            joined = merged(self._held, delta)
            if joined is None:
                out.append(self._held)
                self._held, self._count = delta, 1
            else:
                self._held, self._count = joined, self._count + 1
        if not self._started or max(tokens - self._sent_at, self._count) >= self._every:
            self._started = True
            self._sent_at = tokens
            out.append(self._held)
            self._held, self._count = None, 0
        return out

    def rest(self) -> list[Any]:
        """What is still held, to go out with the finish reason."""
        held, self._held, self._count = self._held, None, 0
        return [] if held is None else [held]

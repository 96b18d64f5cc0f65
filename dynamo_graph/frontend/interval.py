"""A stream interval: several tokens per SSE event (vLLM's and SGLang's `--stream-interval`).

Each SSE event costs the frontend a JSON chunk and the client a parse, whatever it carries; with
`--stream-interval N` a stream's first token goes out at once (the time to first token is
unchanged), then one event per N tokens, and whatever is held when the finish reason comes goes
out with it. What goes out together is merged run by run: content with content and its
log-probabilities, reasoning with reasoning, token ids with token ids; a tool call's delta stays
whole; the order never changes. Deltas are only held per token; merging happens once per event.
"""

from __future__ import annotations

from typing import Any

from dynamo_graph.llm.chat_output import Delta
from dynamo_graph.llm.token_output import TokenDelta


def merged(deltas: list[Any]) -> list[Any]:
    """`deltas` with each run of one kind joined into one delta, in their order."""
    if len(deltas) == 1:
        return deltas
    out: list[Any] = []
    run = [deltas[0]]
    for delta in deltas[1:]:
        kind = _kind(delta)
        if kind is not None and kind == _kind(run[-1]):
            run.append(delta)
        else:
            out.append(_joined(run))
            run = [delta]
    out.append(_joined(run))
    return out


def _kind(delta: Any) -> str | None:
    """What a delta merges with (None: nothing, a tool call's delta stays whole)."""
    if isinstance(delta, TokenDelta):
        return "tokens"
    if delta.tool_call is not None:
        return None
    return "reasoning" if delta.reasoning else "content"


def _joined(run: list[Any]) -> Any:
    first = run[0]
    if len(run) == 1:
        return first
    if isinstance(first, TokenDelta):
        return TokenDelta(
            [t for d in run for t in d.token_ids],
            log_probs=_concat([d.log_probs for d in run]),
            top_logprobs=_concat([d.top_logprobs for d in run]),
            stop_reason=run[-1].stop_reason,
        )
    return Delta(
        "".join([d.text for d in run]),
        reasoning="".join([d.reasoning for d in run]),
        logprobs=_concat([d.logprobs for d in run]),
    )


def _concat(lists: list[list | None]) -> list | None:
    present = [x for x in lists if x is not None]
    return [item for x in present for item in x] if present else None


class StreamInterval:
    """One stream's visible deltas, let out every `every` tokens (`take`) and at the end (`rest`).
    Tokens are counted from the request's completion tokens where its pipeline keeps the count
    as it streams, else one per delta."""

    __slots__ = ("_every", "_held", "_sent_at", "_started")

    def __init__(self, every: int) -> None:
        self._every = every
        self._held: list[Any] = []
        self._sent_at = 0  # completion tokens when an event last went out
        self._started = False

    def take(self, delta: Any, tokens: int) -> list[Any]:
        """What to send now, given a visible `delta` and the request's completion tokens so far
        (nothing until `every` tokens are held; the first at once)."""
        held = self._held
        held.append(delta)
        if self._started and max(tokens - self._sent_at, len(held)) < self._every:
            return _NOTHING
        self._started = True
        self._sent_at = tokens
        self._held = []
        return merged(held)

    def rest(self) -> list[Any]:
        """What is still held, to go out with the finish reason."""
        held, self._held = self._held, []
        return merged(held) if held else _NOTHING


_NOTHING: list[Any] = []  # never appended to: `take` returns it when nothing is due

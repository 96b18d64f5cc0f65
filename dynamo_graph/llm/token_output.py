"""Token-in/token-out output: the engine's token ids as they are, without the detokenizer.

For `/inference/v1/generate` (frontend/generate_tokens/): RL rollouts and evaluation harnesses
want exactly the ids the model sampled, with their log-probabilities as token ids, not text. The
request's stop conditions still hold here, as the postprocessor enforces them for text (the
answer must not depend on the engine honouring them): max_tokens, and the stop ids (requested
ones, and the model's eos unless ignore_eos) once min_tokens are generated. Unlike text, the
stop token is kept: it is the last id of the output, as vLLM returns it, so a trainer sees the
sequence the model produced; `stop_reason` names it when the request asked for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamo_graph.llm.protocol import StopConditions, TopLogprob


@dataclass(slots=True)
class TokenDelta:
    """New token ids (with log-probabilities when asked); the last delta carries the finish
    reason, and `stop_reason` the requested stop token id that ended the output."""

    token_ids: list[int]
    finish_reason: str | None = None
    log_probs: list[float] | None = None
    top_logprobs: list[list[TopLogprob]] | None = None
    stop_reason: int | None = None

    def visible(self) -> bool:
        return bool(self.token_ids)


class TokenLimits:
    """A request's stop conditions applied to token ids; `count` is the completion's length."""

    __slots__ = ("_max", "_min", "_requested", "_stop_ids", "count")

    def __init__(self, sc: StopConditions) -> None:
        self._requested = frozenset(sc.stop_token_ids or ())
        hidden = frozenset() if sc.ignore_eos else frozenset(sc.stop_token_ids_hidden or ())
        self._stop_ids = self._requested | hidden
        self._max = sc.max_tokens
        self._min = sc.min_tokens or 0
        self.count = 0

    def cut(self, ids: list[int]) -> tuple[list[int], str | None, int | None]:
        """(the ids to pass on, "stop"/"length" when a condition ended the output, the
        requested stop id that did)."""
        for i, token_id in enumerate(ids):
            self.count += 1
            if token_id in self._stop_ids and self.count > self._min:
                return ids[: i + 1], "stop", token_id if token_id in self._requested else None
            if self._max is not None and self.count >= self._max:
                return ids[: i + 1], "length", None
        return ids, None, None

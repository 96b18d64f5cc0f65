"""Token log-probabilities in OpenAI's shapes, from what engines report per token.

Engines send, per generated token, its log-probability and the most likely alternatives as
token ids (llm/protocol.py `log_probs`, `top_logprobs`); the frontend has the tokenizer, so
it names the tokens here. Chat responses carry `{"content": [{token, logprob, bytes,
top_logprobs}]}`, completions the older `{tokens, token_logprobs, top_logprobs, text_offset}`.
Only tokens that are shown get an entry: a hidden stop token (eos) is counted in usage but, as
its text is not in the answer, has no log-probability in the response.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tokenizers import Tokenizer

from dynamo_graph.llm.protocol import LLMEngineOutput


@dataclass(slots=True)
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]


class LogprobNamer:
    """Names the tokens of engine outputs' log-probabilities with the model's tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._decode = lru_cache(maxsize=65536)(self._decode_one)
        self._tokenizer = tokenizer

    def _decode_one(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def entries(self, out: LLMEngineOutput, shown: int) -> list[TokenLogprob] | None:
        """Entries for the first `shown` tokens of `out` (those the postprocessor kept)."""
        if out.log_probs is None or shown == 0:
            return None
        decode = self._decode
        tops = out.top_logprobs or []
        entries = []
        for i, (token_id, logprob) in enumerate(zip(out.token_ids[:shown], out.log_probs, strict=False)):
            top = [(decode(t.token_id), t.logprob) for t in tops[i]] if i < len(tops) else []
            entries.append(TokenLogprob(decode(token_id), logprob, top))
        return entries


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    """OpenAI's chat `choices[].logprobs`."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": _bytes(e.token),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": _bytes(t)} for t, lp in e.top],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> dict:
    """OpenAI's completions `choices[].logprobs`; `offset`: characters of text before these tokens."""
    text_offset = []
    for e in entries:
        text_offset.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": text_offset,
    }

"""Per-request postprocessing: engine chunks in, visible text deltas and a finish reason out.

Enforces every stop condition of the request itself (engines are asked to honour them too, but
the frontend's answer must not depend on it): hidden stop tokens (eos) and requested stop token
ids, min_tokens, max_tokens, and stop strings, which can span chunks and multi-byte characters.

Choices, following vLLM / OpenAI:
- `completion_tokens` counts every token up to and including the one that ends generation (an
  eos or stop token id is counted but not shown); tokens an engine sends past that are dropped.
- min_tokens: a stop token at 1-based position <= min_tokens is an ordinary token (decoded and
  shown like any other), and stop strings are looked for only in chunks that end past
  min_tokens. ignore_eos disables the hidden (eos) ids only, not requested stop_token_ids.
- A stop string and everything after it are dropped; text that could still become a stop
  string is held back, and released once it cannot (or when the stream ends).
- The engine's finish reasons map "eos"/"stop" -> "stop", "length" -> "length", and keep
  "cancelled" and "error" distinct so the frontend can decide what to send.
"""

from __future__ import annotations

from bisect import bisect_right
from functools import lru_cache

from dynamo_graph.llm.detokenizer import DetokenizerFactory, IncrementalDetokenizer
from dynamo_graph.llm.protocol import LLMEngineOutput, PreprocessedRequest, StopConditions

_ENGINE_FINISH = {
    "eos": "stop",
    "stop": "stop",
    "length": "length",
    "cancelled": "cancelled",
    "error": "error",
}


@lru_cache(maxsize=256)
def _prefix_table(stops: tuple[str, ...]) -> dict[str, tuple[list[int], list[str]]]:
    """last char c -> (lengths k ascending, stop strings) of the proper prefixes stop[:k] ending
    in c. Cached: clients tend to send the same stop strings on every request."""
    by_char: dict[str, list[tuple[int, str]]] = {}
    for stop in stops:
        for k in range(1, len(stop)):
            by_char.setdefault(stop[k - 1], []).append((k, stop))
    table = {}
    for c, entries in by_char.items():
        entries.sort()
        table[c] = ([k for k, _ in entries], [stop for _, stop in entries])
    return table


class StopStringMatcher:
    """Finds the first stop string in a stream of text pieces, scanning only the held tail plus
    new text, never the whole output."""

    __slots__ = ("_prefixes", "_stops", "held", "matched")

    def __init__(self, stops: list[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._prefixes = _prefix_table(self._stops)
        # Text not shown yet: the longest tail that is a proper prefix of some stop string.
        self.held = ""
        self.matched: str | None = None  # the stop string found (Anthropic's stop_sequence)

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to show, whether a stop string matched; if so nothing more may be shown)."""
        buf = self.held + text if self.held else text
        first = -1
        for stop in self._stops:
            at = buf.find(stop)
            if at != -1 and (first == -1 or at < first):
                first = at
                self.matched = stop
        if first != -1:
            self.held = ""
            return buf[:first], True
        # A match spanning pieces must start in the held tail, so hold the longest suffix of buf
        # that is a proper prefix of a stop string; earlier text can never be part of a match.
        n = len(buf)
        entry = self._prefixes.get(buf[-1]) if n else None
        if entry is not None:
            lengths, stops = entry
            for j in range(bisect_right(lengths, n) - 1, -1, -1):
                k = lengths[j]
                if stops[j].startswith(buf[n - k :]):
                    self.held = buf[n - k :]
                    return buf[: n - k], False
        self.held = ""
        return buf, False

    def release(self) -> str:
        """The held tail, once no more text can complete a stop string."""
        held, self.held = self.held, ""
        return held


class Postprocessor:
    """One request's output stream: call `process` per engine chunk until `done`, then `finish`
    if the stream ended without a finish reason."""

    __slots__ = (
        "_detok",
        "_matcher",
        "_max_tokens",
        "_min_tokens",
        "_stop_ids",
        "completion_tokens",
        "done",
        "finish_reason",
        "shown",
    )

    def __init__(self, detokenizer: IncrementalDetokenizer, stop_conditions: StopConditions) -> None:
        sc = stop_conditions
        stop_ids = set(sc.stop_token_ids or ())
        if not sc.ignore_eos:
            stop_ids.update(sc.stop_token_ids_hidden or ())
        self._detok = detokenizer
        self._stop_ids = frozenset(stop_ids)
        self._max_tokens = sc.max_tokens
        self._min_tokens = sc.min_tokens or 0
        self._matcher = StopStringMatcher(sc.stop) if sc.stop else None
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        # How many of the last chunk's token ids were kept (a prefix of them): their log-probabilities
        # go out with the text.
        self.shown = 0
        # True once a stop condition fired or the engine finished: stop consuming the engine.
        self.done = False

    @classmethod
    def for_request(cls, factory: DetokenizerFactory, request: PreprocessedRequest) -> Postprocessor:
        detok = factory.new(
            skip_special_tokens=request.output_options.skip_special_tokens, prompt_ids=request.token_ids
        )
        return cls(detok, request.stop_conditions)

    def process(self, out: LLMEngineOutput) -> tuple[str, str | None]:
        """(newly visible text, finish reason or None) for one engine chunk."""
        self.shown = 0
        if self.done:
            return "", None
        ids = out.token_ids
        finish: str | None = None
        text = ""
        if ids:
            start = self.completion_tokens
            max_tokens = self._max_tokens
            if self._stop_ids.isdisjoint(ids):
                count = start + len(ids)
                if max_tokens is not None and count >= max_tokens:
                    ids = ids[: max_tokens - start]
                    count = max_tokens
                    finish = "length"
            else:
                ids, count, finish = self._scan_stop_ids(ids, start)
            self.completion_tokens = count
            if ids:
                self.shown = len(ids)
                text = self._detok.add(ids)
        if finish is None and out.finish_reason is not None:
            finish = _ENGINE_FINISH.get(out.finish_reason, out.finish_reason)
        if finish is not None:
            text += self._detok.flush()
        matcher = self._matcher
        if matcher is not None and (text or finish) and self.completion_tokens > self._min_tokens:
            text, matched = matcher.feed(text)
            if matched:
                finish = "stop"
            elif finish is not None:
                text += matcher.release()
        if finish is not None:
            self.done = True
            self.finish_reason = finish
        return text, finish

    def _scan_stop_ids(self, ids: list[int], start: int) -> tuple[list[int], int, str | None]:
        """Token by token, for chunks holding a stop id: (ids to show, token count, finish)."""
        stop_ids, min_tokens, max_tokens = self._stop_ids, self._min_tokens, self._max_tokens
        count = start
        for i, token_id in enumerate(ids):
            count += 1
            if token_id in stop_ids and count > min_tokens:
                return ids[:i], count, "stop"
            if max_tokens is not None and count >= max_tokens:
                return ids[: i + 1], count, "length"
        return ids, count, None

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._matcher.matched if self._matcher is not None else None

    def finish(self) -> str:
        """Text still held when the stream ends without a finish reason ("" once done)."""
        if self.done:
            return ""
        self.done = True
        text = self._detok.flush()
        matcher = self._matcher
        if matcher is not None:
            text, matched = matcher.feed(text)
            if matched:
                self.finish_reason = "stop"
            else:
                text += matcher.release()
        return text

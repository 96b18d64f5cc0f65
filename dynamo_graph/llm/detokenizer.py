"""Incremental detokenization: token ids in, newly complete text out.

A multi-byte UTF-8 character (emoji, CJK) is often split across tokens. Decoding each token on
its own would show replacement characters, and re-decoding the whole output per token costs
O(n) per token. Two strategies:

- Byte-level BPE (GPT-2, Llama-3, Qwen...): each token maps to fixed bytes, independent of its
  neighbours. `DetokenizerFactory` precomputes id -> str for tokens whose bytes are valid UTF-8
  alone (the common case: one dict lookup per token) and id -> bytes for the rest, which go
  through an incremental UTF-8 decoder that holds an incomplete character until it completes.
- Anything else (Metaspace / SentencePiece with byte fallback, WordPiece...): the window
  algorithm of vLLM and TGI: decode a few previous tokens plus the new ones, emit the new suffix
  unless it ends in an incomplete character (U+FFFD).

Either way, the concatenated output of `add()` calls plus `flush()` equals
`tokenizer.decode(all_ids, skip_special_tokens=...)` (for the window strategy: when started
without prompt context; with it, the first token keeps its leading space, as it should).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable

from tokenizers import Tokenizer

# Tokens of prompt context the window strategy starts with, as vLLM does: enough for decoders
# that strip a leading space from the first token not to strip one from the first output token.
_WINDOW_CONTEXT = 5
_REPLACEMENT = "\ufffd"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, as the ByteLevel pre-tokenizer uses."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


# A byte-level BPE vocabulary's characters -> the bytes they stand for (also used by engines/mistralrs.py).
BYTE_LEVEL_CHAR_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _byte_level_bytes(token: str) -> bytes:
    """A token's bytes as tokenizers' ByteLevel decoder computes them: the mapped bytes when
    every character is in the byte map, else the token's own UTF-8 (added tokens like "a b")."""
    try:
        return bytes(BYTE_LEVEL_CHAR_TO_BYTE[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def _standalone_text(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


class DetokenizerFactory:
    """Per-tokenizer tables, built once per model and shared by every request's detokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
        self.byte_level = decoder.get("type") == "ByteLevel"
        # Per skip_special_tokens flag: id -> text when the token decodes alone, id -> bytes.
        self._texts: dict[bool, dict[int, str]] = {}
        self._bytes: dict[bool, dict[int, bytes]] = {}
        if self.byte_level:
            self._build_tables()

    def _build_tables(self) -> None:
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        special = {i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}
        shown = {i: _byte_level_bytes(tok) for tok, i in vocab.items()}
        skipped = {i: b"" if i in special else b for i, b in shown.items()}
        for skip, table in ((False, shown), (True, skipped)):
            self._bytes[skip] = table
            self._texts[skip] = {i: s for i, b in table.items() if (s := _standalone_text(b)) is not None}

    def new(
        self, *, skip_special_tokens: bool, prompt_ids: list[int] | None = None
    ) -> IncrementalDetokenizer:
        """A detokenizer for one request's output stream (about a microsecond)."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens, prompt_ids=prompt_ids)


class IncrementalDetokenizer:
    """Turns one stream of token ids into text, never splitting a character.

    Pass a `DetokenizerFactory` (cheap); passing a bare `Tokenizer` builds its tables first.
    """

    __slots__ = (
        "_bytes",
        "_decode",
        "_ids",
        "_prefix_text",
        "_read_offset",
        "_skip",
        "_texts",
        "_utf8",
    )

    def __init__(
        self,
        source: DetokenizerFactory | Tokenizer,
        *,
        skip_special_tokens: bool,
        prompt_ids: list[int] | None = None,
    ) -> None:
        factory = source if isinstance(source, DetokenizerFactory) else DetokenizerFactory(source)
        self._skip = skip_special_tokens
        # Incremental UTF-8 decoder, created on the first token that does not decode alone;
        # None again once it holds no partial character.
        self._utf8: codecs.IncrementalDecoder | None = None
        if factory.byte_level:
            self._texts: dict[int, str] | None = factory._texts[skip_special_tokens]
            self._bytes = factory._bytes[skip_special_tokens]
            return
        self._texts = None
        self._decode: Callable[..., str] = factory.tokenizer.decode
        self._ids = list(prompt_ids[-_WINDOW_CONTEXT:]) if prompt_ids else []
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids, skip_special_tokens=skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Text newly completed by these tokens (possibly "" while a character is incomplete)."""
        texts = self._texts
        if texts is None:
            return self._add_window(token_ids)
        if self._utf8 is None:
            if len(token_ids) == 1:
                text = texts.get(token_ids[0])
                if text is not None:
                    return text
            else:
                parts = [texts.get(i) for i in token_ids]
                if None not in parts:
                    return "".join(parts)  # type: ignore[arg-type]
        return self._add_bytes(token_ids)

    def _add_bytes(self, token_ids: list[int]) -> str:
        utf8 = self._utf8
        if utf8 is None:
            # "replace": an invalid byte mid-stream shows as U+FFFD, as tokenizer.decode does;
            # an incomplete trailing character is held, not replaced.
            utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        table = self._bytes
        text = utf8.decode(b"".join([table.get(i, b"") for i in token_ids]))
        self._utf8 = utf8 if utf8.getstate()[0] else None
        return text

    def _add_window(self, token_ids: list[int]) -> str:
        ids = self._ids
        ids.extend(token_ids)
        text = self._decode(ids, skip_special_tokens=self._skip)
        prefix_len = len(self._prefix_text)
        if len(text) <= prefix_len or text.endswith(_REPLACEMENT):
            return ""
        # Slide the window: the tokens read since the last emit become the next prefix.
        del ids[: self._read_offset]
        self._read_offset = len(ids)
        self._prefix_text = self._decode(ids, skip_special_tokens=self._skip)
        return text[prefix_len:]

    def flush(self) -> str:
        """Text still held at the end of the stream (an incomplete character shows as U+FFFD)."""
        if self._texts is not None:
            utf8, self._utf8 = self._utf8, None
            return utf8.decode(b"", final=True) if utf8 is not None else ""
        ids = self._ids
        if len(ids) == self._read_offset:
            return ""
        text = self._decode(ids, skip_special_tokens=self._skip)
        prefix_len = len(self._prefix_text)
        del ids[:]
        self._read_offset = 0
        self._prefix_text = ""
        return text[prefix_len:]

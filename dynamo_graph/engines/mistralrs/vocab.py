"""Token bytes -> token ids: mistral.rs streams text, but with logprobs each chunk carries the
sampled token's raw bytes, which map back to the id through the model's vocabulary (why this is
exact, and its fallback: docs/engines/mistralrs.md)."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from dynamo_graph.llm.detokenizer import BYTE_LEVEL_CHAR_TO_BYTE

if TYPE_CHECKING:
    from tokenizers import Tokenizer

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """Maps a token's raw bytes (as mistral.rs reports them in logprobs) back to its id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
        byte_level = "ByteLevel" in json.dumps(decoder)
        u2b = BYTE_LEVEL_CHAR_TO_BYTE
        added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self.ids: dict[bytes, int] = {}
        self.ambiguous: dict[bytes, list[int]] = {}
        for text, token_id in sorted(
            tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1]
        ):
            if token_id in added:
                raw = added[token_id].encode()
            elif byte_level and all(c in u2b for c in text):
                raw = bytes(u2b[c] for c in text)
            elif (m := _BYTE_FALLBACK.fullmatch(text)) is not None:
                raw = bytes([int(m.group(1), 16)])
            else:
                raw = text.replace("\u2581", " ").encode()
            first = self.ids.setdefault(raw, token_id)
            if first != token_id:
                self.ambiguous.setdefault(raw, [first]).append(token_id)

    def lookup(self, raw: bytes, hints: list[int]) -> int | None:
        choices = self.ambiguous.get(raw)
        if choices is not None:
            return next((h for h in hints if h in choices), choices[0])
        return self.ids.get(raw)

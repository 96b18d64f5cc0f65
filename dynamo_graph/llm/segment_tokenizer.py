"""Tokenizing a rendered chat prompt by segments, so a prefix tokenized before costs a dict lookup.

A chat prompt is mostly what earlier requests already sent: the system prompt, a shared
document, the turns so far. The chat template puts special tokens between messages
(`<|start_header_id|>`, `<|eot_id|>`, ...), and a Hugging Face tokenizer splits its input at
added tokens *before* normalizing and pre-tokenizing the pieces between them, each piece on its
own. So the ids of `A <special> B` are the ids of `A`, the special token's id, and the ids of
`B`: the text between two special tokens can be tokenized once and its ids reused whenever the
same text comes back, wherever it sits in the prompt. The frontend's tokenization of a 4k-token
conversation then costs the new turn's tokens, not the whole history's.

When that cannot be guaranteed, the cache is off and every prompt is tokenized whole:
- a special token that strips the whitespace around it, is normalized, or must be a single word
  changes the neighbouring pieces, so any such token turns the cache off;
- some pre-tokenizers treat the first piece of an input differently from the rest
  (SentencePiece's `prepend_scheme: first`): a probe at load time encodes texts that mix special
  tokens with spaces, newlines, digits and non-ASCII both ways and turns the cache off on any
  difference.

Only segments of at least `MIN_CACHED_CHARS` are kept (short ones are cheap, and would crowd the
cache); uncached segments of a prompt are tokenized in one `encode_batch` call. The cache holds
at most `DYN_TOKENIZE_CACHE_MB` (64) of text and ids, least recently used out first. It belongs
to one tokenizer object, so a changed tokenizer or template never meets stale ids.

`encode_prefixed` also names the prompt's leading prefixes made of cached segments (with the
special tokens and short pieces between them), so that the KV router can reuse their block
hashes (router/kv/prefix_hashes.py): each is a token count and a key, the xxh3-128 of the
previous prefix's key and the xxh3-128 digests of the token ids of the pieces since (a
special token, a short piece, a cached segment). The key is thus a function of the ids alone:
whatever tokenizer or template produced them, equal keys mean equal ids (up to a 128-bit
collision). A cached segment's digest is computed once, when it is cached.
"""

from __future__ import annotations

import logging
import os
import re
from array import array
from collections import OrderedDict

from tokenizers import Tokenizer
from xxhash import xxh3_128_digest

log = logging.getLogger(__name__)
MIN_CACHED_CHARS = 256
Prefixes = list[tuple[int, bytes]]  # (leading token count, key of those ids), shortest first
MAX_PREFIXES = 4  # the longest ones: those an earlier request (an earlier turn) can have named


def _digest(ids: array) -> bytes:
    return xxh3_128_digest(memoryview(ids).cast("B"))


_PROBE_TEXTS = (
    "You are a helpful assistant.\n\n",
    " leading space, trailing space ",
    "\n\nnewlines\n",
    "digits 12345 and 3.14159",
    "ünïcödé — “quotes” 日本語 🙂",
    "",
    "user",
    "  ",
)


def _cache_bytes_from_env() -> int:
    raw = (os.environ.get("DYN_TOKENIZE_CACHE_MB") or "").strip()
    try:
        mb = float(raw) if raw else 64.0
    except ValueError:
        raise ValueError(f"DYN_TOKENIZE_CACHE_MB must be a number of MiB, not {raw!r}") from None
    return max(int(mb * (1 << 20)), 0)


class SegmentTokenizer:
    """`encode(text)` gives exactly `tokenizer.encode(text, add_special_tokens=False).ids`."""

    def __init__(self, tokenizer: Tokenizer, *, max_bytes: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_bytes = _cache_bytes_from_env() if max_bytes is None else max_bytes
        self._cache: OrderedDict[str, tuple[array, bytes]] = OrderedDict()  # ids, their digest
        self.held_bytes = 0
        self.hits = 0
        self.misses = 0
        specials: dict[str, int] = {}
        clean = True
        for token_id, token in tokenizer.get_added_tokens_decoder().items():
            if not token.special:
                continue
            specials[token.content] = token_id
            clean = clean and not (token.lstrip or token.rstrip or token.normalized or token.single_word)
        self._special_ids = specials
        self._special_digests = {i: _digest(array("I", [i])) for i in specials.values()}
        self._split = None
        if specials and clean and self.max_bytes > 0:
            alternatives = sorted(specials, key=len, reverse=True)  # longest first, as the tokenizer matches
            self._split = re.compile("(" + "|".join(re.escape(s) for s in alternatives) + ")")
            if not self._agrees_on_probes():
                log.info("tokenizer: segments do not tokenize independently; prompts are tokenized whole")
                self._split = None

    @property
    def enabled(self) -> bool:
        return self._split is not None

    def _whole(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _probe_texts(self) -> list[str]:
        """Fixed texts, and words of the tokenizer's own vocabulary (a probe of unknown words
        could not tell a first piece's treatment from the others')."""
        special_ids = set(self._special_ids.values())
        words = []
        for token_id in range(min(self.tokenizer.get_vocab_size(), 512)):
            if token_id not in special_ids:
                word = self.tokenizer.decode([token_id])
                if word.strip():
                    words.append(word)
            if len(words) >= 16:
                break
        return [*_PROBE_TEXTS, *words, " ".join(words)]

    def _agrees_on_probes(self) -> bool:
        specials = list(self._special_ids)
        probes = self._probe_texts()
        n = len(probes)
        for i, first in enumerate(probes):
            second, special = probes[(7 * i + 3) % n], specials[i % len(specials)]
            text = first + special + second + specials[(i + 1) % len(specials)] + first
            if self._segmented(text, cache=False)[0] != self._whole(text):
                return False
        return True

    def encode(self, text: str) -> list[int]:
        return self.encode_prefixed(text)[0]

    def encode_prefixed(self, text: str) -> tuple[list[int], Prefixes]:
        """The ids of `text`, and its leading prefixes that end with a cached segment."""
        if self._split is None:
            return self._whole(text), []
        return self._segmented(text, cache=True)

    def _segmented(self, text: str, *, cache: bool) -> tuple[list[int], Prefixes]:
        assert self._split is not None
        parts = self._split.split(text)  # text, special, text, special, ..., text
        pieces: list[list[int] | array | None] = [None] * len(parts)
        digests: list[bytes | None] = [None] * len(parts)
        missing: list[int] = []
        for k, part in enumerate(parts):
            if k % 2:
                special = self._special_ids[part]
                pieces[k] = [special]
                digests[k] = self._special_digests[special]
            elif part:
                found = self._cache.get(part) if cache and len(part) >= MIN_CACHED_CHARS else None
                if found is None:
                    missing.append(k)
                else:
                    self._cache.move_to_end(part)
                    self.hits += 1
                    pieces[k], digests[k] = found
        if missing:
            encoded = self.tokenizer.encode_batch([parts[k] for k in missing], add_special_tokens=False)
            for k, enc in zip(missing, encoded, strict=True):
                pieces[k] = enc.ids
                if cache and len(parts[k]) >= MIN_CACHED_CHARS:
                    self.misses += 1
                    digests[k] = self._remember(parts[k], enc.ids)
        ids: list[int] = []
        prefixes: Prefixes = []
        key = b""  # of the prefix up to the last cached segment
        since: list[bytes] = []  # digests of the pieces after it
        leading = cache  # still within the leading run of specials, short and cached pieces
        for k, piece in enumerate(pieces):
            if piece is None:
                continue
            ids.extend(piece)
            if not leading:
                continue
            digest = digests[k]
            if digest is None and len(parts[k]) < MIN_CACHED_CHARS:
                digest = _digest(array("I", piece))
            elif digest is None:  # a long segment too big to cache
                leading = False
                continue
            since.append(digest)
            if k % 2 == 0 and digests[k] is not None:  # a cached segment ends here
                key = xxh3_128_digest(key + b"".join(since))
                since.clear()
                prefixes.append((len(ids), key))
        return ids, prefixes[-MAX_PREFIXES:]

    def _remember(self, segment: str, ids: list[int]) -> bytes | None:
        """Cache a segment's ids (if it fits); their digest, or None if not cached."""
        stored = array("I", ids)
        size = len(segment) + 4 * len(stored) + 16
        if size > self.max_bytes:
            return None
        digest = _digest(stored)
        self._cache[segment] = (stored, digest)
        self.held_bytes += size
        while self.held_bytes > self.max_bytes:
            old, (old_ids, _) = self._cache.popitem(last=False)
            self.held_bytes -= len(old) + 4 * len(old_ids) + 16
        return digest

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

Every piece between special tokens is cached, short ones too: the template's own words (role
names, separators) and earlier turns' short messages come back on every request. A piece not
in the cache costs one `encode` call; its ids are kept as a tuple, which a prompt's id list
extends at the cost of reference counts (converting a compact array back into Python ints cost
more than the rest of the lookup: benchmarks/bench_prompt_stages.py). Only *long* pieces (at
least `LONG_SEGMENT_CHARS`) end the prefixes named for the router, below, so that a request's
unique short question never becomes the prefix a cache remembers. The cache holds at most
`DYN_TOKENIZE_CACHE_MB` (64) by `entry_bytes`' count of its text, id tuples and bookkeeping,
least recently used out first. It belongs to one tokenizer object, so a changed tokenizer or
template never meets stale ids.

A long piece not in the cache may still start with one that is: a shared document and a new
question in one user message. For byte-level BPE tokenizers with a regex pre-tokenizer (GPT-2,
Llama 3, Qwen), its ids are then the cached piece's ids up to the last safe cut before the two
texts part, plus the ids of the rest (prefix_reuse.py); a prefix for the router ends at the cut
of the checkpoint that found the cached piece (so one prefix per document, whatever the
question). A load-time probe checks that on the tokenizer and turns it off, logging why, where
it does not hold; `DYN_TOKENIZE_PREFIX_REUSE=0` turns it off too.

`encode_prefixed` also names the prompt's leading prefixes made of cached segments (with the
special tokens and short pieces between them), so that the KV router can reuse their block
hashes (router/kv/prefix_hashes.py): each is a token count and a key, the xxh3-128 of the
previous prefix's key and the xxh3-128 digests of the token ids of the pieces since (a
special token, a short piece, a long segment). The key is thus a function of the ids alone:
whatever tokenizer or template produced them, equal keys mean equal ids (up to a 128-bit
collision). A cached segment's digest is computed once, when it is cached.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from tokenizers import Tokenizer
from xxhash import xxh3_128_digest

from dynamo_graph.llm.prefix_reuse import (
    CHECKPOINT_BYTES,
    STRIDE,
    Checkpoint,
    PrefixIndex,
    cuts_refusal,
    reuse_refusal,
)

log = logging.getLogger(__name__)
LONG_SEGMENT_CHARS = 256
Prefixes = list[tuple[int, bytes]]  # (leading token count, key of those ids), shortest first
_Entry = tuple[tuple[int, ...], bytes, list[tuple[int, int]], int]
MAX_PREFIXES = 4  # the longest ones: those an earlier request (an earlier turn) can have named
_ENTRY_OVERHEAD = 200


def _digest(ids: Sequence[int]) -> bytes:
    return xxh3_128_digest(memoryview(array("I", ids)).cast("B"))


def entry_bytes(text: str, token_count: int, checkpoints: int = 0) -> int:
    """What one cached piece holds, counted from above: its text, a tuple slot and an int object
    per id, and the tuple's, digest's and map slot's headers; with `checkpoints` (a long piece's,
    prefix_reuse.py), those and its tokens' offsets (4 bytes each)."""
    size = sys.getsizeof(text) + 36 * token_count + _ENTRY_OVERHEAD
    if checkpoints:
        size += CHECKPOINT_BYTES * checkpoints + 4 * token_count
    return size


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


# Continuations of a probe document at its checkpoints: what could join the text before a cut.
_REUSE_TAILS = ("  \n", "\n\n  x", "'s", "123", "\u0301e", "\xa0y", ". Why?")
_REUSE_PROBE_ENDS = 12  # checkpoint ends probed per tail


# The load-time verdict on prefix reuse, per tokenizer object (a model's pipelines, and tests,
# make many segment tokenizers of one tokenizer; the probe costs ~100 encodes).
_REUSE_VERDICTS: weakref.WeakKeyDictionary[Tokenizer, str | None] = weakref.WeakKeyDictionary()


def _reuse_from_env() -> bool:
    return (os.environ.get("DYN_TOKENIZE_PREFIX_REUSE") or "1").strip().lower() not in {
        "0",
        "false",
        "no",
        "off",
    }


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
        # ids, digest, the keys of the checkpoints of a long piece (prefix_reuse.py), bytes counted
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        self.held_bytes = 0
        self.hits = 0  # of long segments (those that name prefixes)
        self.misses = 0
        self.prefix_hits = 0  # long segments tokenized from a cached prefix's ids on
        specials: dict[str, int] = {}
        words: list[str] = []
        clean = True
        for token_id, token in tokenizer.get_added_tokens_decoder().items():
            if not token.special:
                words.append(token.content)
                continue
            specials[token.content] = token_id
            clean = clean and not (token.lstrip or token.rstrip or token.normalized or token.single_word)
        self._special_ids = specials
        self._special_digests = {i: _digest([i]) for i in specials.values()}
        self._split = None
        if specials and clean and self.max_bytes > 0:
            alternatives = sorted(specials, key=len, reverse=True)  # longest first, as the tokenizer matches
            self._split = re.compile("(" + "|".join(re.escape(s) for s in alternatives) + ")")
            if not self._agrees_on_probes():
                log.info("tokenizer: segments do not tokenize independently; prompts are tokenized whole")
                self._split = None
        self._prefixes: PrefixIndex | None = None
        if self._split is not None and _reuse_from_env():
            if tokenizer in _REUSE_VERDICTS:
                refusal = _REUSE_VERDICTS[tokenizer]
            else:
                refusal = _REUSE_VERDICTS[tokenizer] = reuse_refusal(
                    tokenizer
                ) or self._reuse_refusal_on_probes(words)
            if refusal is None:
                self._prefixes = PrefixIndex(words)
            else:
                log.info("tokenizer: no reuse of a cached prefix inside a segment: %s", refusal)

    @property
    def reuses_prefixes(self) -> bool:
        """Whether a long piece is tokenized from the ids of a cached piece it starts with."""
        return self._prefixes is not None

    @property
    def enabled(self) -> bool:
        return self._split is not None

    def __len__(self) -> int:
        """Pieces in the cache."""
        return len(self._cache)

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

    def _reuse_refusal_on_probes(self, words: list[str]) -> str | None:
        """A probe document: each of its safe cuts must start a pre-token, whatever follows;
        cached, then continued at checkpoints by text that could join what precedes a cut, the
        ids through the reuse path must be the whole text's."""
        document = " ".join(self._probe_texts()) + " Value: 1234567, it's done!\n\n  - item\t(x)  "
        document += "end" + " " * (STRIDE + 8) + "x"  # a checkpoint inside a run of spaces
        while len(document) < 3 * STRIDE:
            document += document
        if refusal := cuts_refusal(self.tokenizer, document, _REUSE_TAILS):
            return refusal
        self._prefixes = PrefixIndex(words)
        special = next(iter(self._special_ids))
        ends = range(STRIDE + 1, len(document), max((len(document) - STRIDE) // _REUSE_PROBE_ENDS, 1))
        try:
            self._segmented(special + document, cache=True)
            for end in ends:
                for tail in _REUSE_TAILS:
                    text = special + document[:end] + tail + special
                    if self._segmented(text, cache=True)[0] != self._whole(text):
                        return f"a probe differs from whole tokenization: {document[end - 12 : end] + tail!r}"
            if not self.prefix_hits:
                return "the probes found no cut to reuse a prefix at"
            return None
        finally:
            self._prefixes = None
            self._cache.clear()
            self.held_bytes = self.hits = self.misses = self.prefix_hits = 0

    def encode(self, text: str) -> list[int]:
        return self.encode_prefixed(text)[0]

    def encode_prefixed(self, text: str) -> tuple[list[int], Prefixes]:
        """The ids of `text`, and its leading prefixes that end with a cached segment."""
        if self._split is None:
            return self._whole(text), []
        return self._segmented(text, cache=True)

    def _segmented(self, text: str, *, cache: bool) -> tuple[list[int], Prefixes]:
        assert self._split is not None
        ids: list[int] = []
        prefixes: Prefixes = []
        key = b""  # of the prefix up to the last long segment
        since: list[bytes] = []  # digests of the pieces after it
        leading = cache  # still within the leading run of specials, short and cached pieces
        entries = self._cache
        special_ids = self._special_ids
        for k, part in enumerate(self._split.split(text)):  # text, special, text, ..., text
            if k % 2:
                special = special_ids[part]
                ids.append(special)
                if leading:
                    since.append(self._special_digests[special])
                continue
            if not part:
                continue
            long = len(part) >= LONG_SEGMENT_CHARS
            found = entries.get(part) if cache else None
            if found is not None:
                entries.move_to_end(part)
                if long:
                    self.hits += 1
                piece, digest, _, _ = found
            elif long and cache and self._prefixes is not None:
                piece, digest, point = self._long_piece(part)
                if point is not None:  # the ids up to a cut in a cached piece: a prefix ends there
                    ids.extend(piece)
                    if leading:
                        assert point.digest is not None
                        since.append(point.digest)
                        key = xxh3_128_digest(key + b"".join(since))
                        since.clear()
                        prefixes.append((len(ids) - len(piece) + point.count, key))
                        leading = False  # what follows the cut is new: no longer prefix ends past it
                    continue
            else:
                # One piece, one call: encode_batch would wake the tokenizer's thread pool,
                # which costs more CPU than it saves on a request's few short pieces.
                piece = self._whole(part)
                digest = None
                if cache:
                    if long:
                        self.misses += 1
                    digest = self._remember(part, piece)
            ids.extend(piece)
            if not leading:
                continue
            if digest is None:
                if long:  # too big to cache: no prefix can end past it
                    leading = False
                    continue
                digest = _digest(piece)
            since.append(digest)
            if long:  # a long cached segment ends a prefix here
                key = xxh3_128_digest(key + b"".join(since))
                since.clear()
                prefixes.append((len(ids), key))
        return ids, prefixes[-MAX_PREFIXES:]

    def _long_piece(self, part: str) -> tuple[list[int], bytes | None, Checkpoint | None]:
        """A long piece not in the cache: its ids from those of the cached piece it shares most
        with (and the checkpoint that names the shared prefix), else whole; cached when it adds
        checkpoints."""
        assert self._prefixes is not None
        reuse = self._prefixes.find(part)
        if reuse is None:
            encoding = self.tokenizer.encode(part, add_special_tokens=False)
            self.misses += 1
            ids = encoding.ids
            return ids, self._remember(part, ids, array("I", [start for start, _ in encoding.offsets])), None
        point = reuse.point
        self._cache.move_to_end(point.source)
        source_ids = self._cache[point.source][0]
        if point.digest is None:  # for the prefix that ends at the checkpoint's cut, once
            point.digest = _digest(source_ids[: point.count])
        rest = self.tokenizer.encode(part[reuse.cut :], add_special_tokens=False)
        count = reuse.count
        # One copy and the tail dropped costs less than a slice's two copies, unless the tail is long.
        ids = list(source_ids) if 2 * count >= len(source_ids) else list(source_ids[:count])
        del ids[count:]
        ids += rest.ids
        self.prefix_hits += 1
        digest = None
        if len(part) - reuse.shared >= STRIDE:  # text past the shared part: checkpoints of its own
            starts = point.starts[:count]
            starts.extend([reuse.cut + start for start, _ in rest.offsets])
            digest = self._remember(part, ids, starts, point.end)
        return ids, digest, point

    def _remember(
        self, segment: str, ids: list[int], starts: array | None = None, first: int = 0
    ) -> bytes | None:
        """Cache a piece's ids (if it fits); their digest, or None if not cached. `starts`: its
        tokens' offsets, for checkpoints past `first` (where those of the text it was found by
        end)."""
        if entry_bytes(segment, len(ids)) > self.max_bytes:
            return None
        keys = []
        if starts is not None and self._prefixes is not None:
            keys = self._prefixes.add(segment, starts, first)
        size = entry_bytes(segment, len(ids), len(keys))
        if size > self.max_bytes:
            assert self._prefixes is not None
            self._prefixes.discard(segment, keys)
            return None
        digest = _digest(ids)
        self._cache[segment] = (tuple(ids), digest, keys, size)
        self.held_bytes += size
        while self.held_bytes > self.max_bytes:
            old, (_, _, old_keys, old_size) = self._cache.popitem(last=False)
            self.held_bytes -= old_size
            if old_keys:
                assert self._prefixes is not None
                self._prefixes.discard(old, old_keys)
        return digest

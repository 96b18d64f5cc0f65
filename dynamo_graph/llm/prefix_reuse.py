"""Reusing the ids of a cached text that a new text starts with: a document, then a question, in one message.

The segment tokenizer (segment_tokenizer.py) caches the text between special tokens whole, so
a shared document followed by a new question in the *same* message is a piece it has never
seen, tokenized whole on every request. This index finds the longest cached long piece that
the new piece starts with, and tokenizes only what follows a safe cut inside the shared text.

Why a cut can be safe. A byte-level BPE tokenizer with a regex pre-tokenizer (GPT-2's
`ByteLevel(use_regex)`, or a `Split` regex then `ByteLevel`: Llama 3, Qwen, GPT-4-style) splits
its input into pre-tokens by a regex scanned left to right and merges each pre-token on its own,
so the ids of a text are its pre-tokens' ids, concatenated. If a new text S shares its first X
characters with a cached text C, and a pre-token boundary b < X - 1 of C is also one of S, with
every pre-token before it decided by characters before X, then

    ids(S) = ids(C)[:n] + ids(S[b:])        (n: C's tokens that start before b)

The boundary used is a space (U+0020) after a character that is not whitespace. In those split
patterns no alternative matches a non-space followed by a space, so a pre-token ends there, and
the alternative that matched it stopped on the space itself (each one that could run on is a run
of letters, digits, punctuation or newlines, which a space ends), so nothing after the space can
move it. Whitespace runs are *not* cut points: `\\s*[\\r\\n]+` and `\\s+(?!\\S)` choose their end by
what follows the run (in Llama 3, the prefix "a\\n  " pre-tokenizes as "a", "\\n", "  ", but
"a\\n  \\n" as "a", "\\n  \\n": the prefix's second-to-last pre-token grows). The cut is taken
before the shared text's end (b < X - 1), so the match ending at b saw only shared characters.

What could still break it is checked, and reuse is then off for that tokenizer
(`reuse_refusal`, and SegmentTokenizer's load-time probe that runs texts both ways): another
model than BPE, BPE dropout, a normalizer other than NFC (NFC composes only within a starter and
its combining marks, and the space is a starter), a pre-tokenizer other than regex splits and
byte-level, a prefix space added to every input. Added tokens that are not special (the segment
tokenizer splits at special ones) are matched before pre-tokenization, so a cut is refused when
one occurs near it. Text without spaces (e.g. Chinese or Japanese) has no cut and is tokenized
whole.

Checkpoints: a cached long text C gets one every `STRIDE` characters, keyed by a hash of C[:x]
(`prefix_keys`: xxh3-64 of its bytes while it is ASCII, streamed over C; Python's hash of the
slice past C's first other character), holding the last safe cut before x and the count of C's
tokens before it; C's token start offsets are kept with it. A new text's longest cached prefix
is found by a binary search over its own x (the checkpoints of one text are all there, so a
shorter prefix of a hit is a hit too; an ASCII probe hashes a view of the new text's one
encoding, where a slice and its hash cost ~6x more), verified once by comparing the text.
From that checkpoint the exact shared length X is found by comparing the two texts (a binary
search of `startswith`), so the cut is the last safe one before X, and the count of C's tokens
before it comes from C's offsets: a reuse tokenizes only the word the texts part in and what
follows. The prefix named for the router (segment_tokenizer.py) stays the checkpoint's, whose
digest is computed once, so requests that part at different words of the same document still
name one prefix. A text found this way is cached itself only when it goes on for a stride or
more past the shared part (else a document's thousand questions would each cache a copy of the
document's ids). The checkpoints count in the segment cache's budget and leave with their text.
"""

from __future__ import annotations

import json
import re
from array import array
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenizers import Tokenizer
from xxhash import xxh3_64, xxh3_64_intdigest

STRIDE = 128  # characters between checkpoints: the least a text must share with a cached one
CHECKPOINT_BYTES = 320  # a checkpoint's key, object, digest and map slot (in the cache's budget)
_SPLIT_BEHAVIORS = {"Isolated", "Removed", "MergedWithPrevious", "MergedWithNext"}


def reuse_refusal(tokenizer: Tokenizer) -> str | None:
    """Why ids of a cached prefix cannot be reused with this tokenizer (None: they can, if the
    load-time probe agrees)."""
    model = tokenizer.model
    if type(model).__name__ != "BPE":
        return f"its model is {type(model).__name__}, not BPE"
    if model.dropout:
        return "BPE dropout is random"
    normalizer = _spec(tokenizer.normalizer)
    if normalizer is not None and normalizer.get("type") != "NFC":
        return f"its normalizer {normalizer.get('type')} may join text across a cut"
    pre = _spec(tokenizer.pre_tokenizer)
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre]
    regex = False
    for step in steps:
        kind = (step or {}).get("type")
        if kind == "ByteLevel":
            if step.get("add_prefix_space"):
                return "its ByteLevel pre-tokenizer adds a prefix space to every input"
            regex = regex or bool(step.get("use_regex"))
        elif kind == "Split":
            if "Regex" not in step.get("pattern", {}) or step.get("invert"):
                return "its Split pre-tokenizer is not a plain regex split"
            if step.get("behavior") not in _SPLIT_BEHAVIORS:
                return f"its Split behavior {step.get('behavior')} is not known here"
            regex = True
        else:
            return f"its pre-tokenizer {kind} is not a regex split"
    if not regex:
        return "its pre-tokenizer splits by no regex"
    return None


def _spec(part: object) -> dict | None:
    """A tokenizer part's JSON (its own, not the whole tokenizer's, which holds the vocabulary)."""
    return None if part is None else json.loads(part.__getstate__())


@dataclass(slots=True, eq=False)
class Checkpoint:
    """C[:x] of a cached text C: the safe cut `cut` before x, and C's `count` tokens before it."""

    source: str  # the cached text C
    starts: array  # the character offset of each of C's tokens (shared by C's checkpoints)
    end: int  # x
    cut: int
    count: int
    digest: bytes | None = field(default=None)  # of C's first `count` ids, from its first reuse


@dataclass(slots=True)
class Reuse:
    """What a new text takes from a cached one: C's first `count` ids, up to the safe cut `cut`
    before the `shared` characters the texts start with; `point`, the checkpoint that found C,
    names a prefix (its `count` ids) for the router."""

    point: Checkpoint
    cut: int
    count: int
    shared: int


def ascii_head(text: str) -> bytes:
    """`text` encoded as ASCII up to its first character that is not ASCII (all of it, mostly)."""
    try:
        return text.encode("ascii")
    except UnicodeEncodeError as err:
        return text[: err.start].encode("ascii")


def prefix_keys(text: str) -> Callable[[int], int]:
    """x -> the key of text[:x]: while text[:x] is ASCII, the xxh3-64 of its bytes, each probe
    hashing a view of one encoding (no copy); past the first other character, Python's hash of
    the slice. Which one is a property of text[:x] itself, so any text with that prefix agrees."""
    view = memoryview(ascii_head(text))
    ascii_chars = len(view)
    return lambda x: xxh3_64_intdigest(view[:x]) if x <= ascii_chars else hash(text[:x])


def shared_length(text: str, other: str, start: int = 0) -> int:
    """How many leading characters `text` and `other` share, knowing they share `start`."""
    lo, hi = start, min(len(text), len(other))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(other[lo:mid], lo):
            lo = mid
        else:
            hi = mid - 1
    return lo


def safe_cut(text: str, before: int, floor: int = 0) -> int:
    """The last position in (floor, before) holding a space after a non-whitespace character,
    else `floor`."""
    b = text.rfind(" ", floor + 1, before)
    while b > floor and text[b - 1].isspace():
        b = text.rfind(" ", floor + 1, b)
    return max(b, floor)


def cuts_refusal(tokenizer: Tokenizer, document: str, tails: tuple[str, ...]) -> str | None:
    """Why some safe cut of `document` is not where a pre-token starts, once the text goes on
    with any of `tails` just past it (None: every one is)."""
    pre = tokenizer.pre_tokenizer
    cut = safe_cut(document, len(document))
    while cut > 0:
        for tail in ("", *tails):
            text = document[: cut + 2] + tail
            if not any(start == cut for _, (start, _) in pre.pre_tokenize_str(text)):
                return f"no pre-token starts at the space in {text[max(cut - 12, 0) :]!r}"
        cut = safe_cut(document, cut)
    return None


class PrefixIndex:
    """Checkpoints of cached long texts; `find` gives a new text's longest cached prefix."""

    def __init__(self, added_words: list[str]) -> None:
        """`added_words`: the tokenizer's added tokens that are not special."""
        self._points: dict[tuple[int, int], Checkpoint] = {}
        self._added = None
        self._reach = 0
        if added_words:
            words = sorted(added_words, key=len, reverse=True)
            self._added = re.compile("|".join(re.escape(w) for w in words))
            self._reach = len(words[0])

    def __len__(self) -> int:
        return len(self._points)

    def add(self, text: str, starts: array, first: int = 0) -> list[tuple[int, int]]:
        """Checkpoints for `text` past `first` (where those of the cached text it was found by
        end); `starts`: the character offset of each of its tokens. Returns their keys, to
        `discard` with the text."""
        keys = []
        head = ascii_head(text)  # streamed: each checkpoint's key hashes one more stride of it
        digest = xxh3_64(head[:first])
        for x in range(first + STRIDE, len(text) + 1, STRIDE):  # those up to `first` are C's
            if x <= len(head):  # (x - STRIDE >= first: the stream holds text[:x - STRIDE])
                digest.update(head[x - STRIDE : x])
                key = (x, digest.intdigest())
            else:
                key = (x, hash(text[:x]))
            cut = safe_cut(text, x - 1)
            self._points[key] = Checkpoint(text, starts, x, cut, bisect_left(starts, cut))
            keys.append(key)
        return keys

    def discard(self, text: str, keys: list[tuple[int, int]]) -> None:
        """`text` left the cache: its checkpoints go (those not taken over by a newer text)."""
        points = self._points
        for key in keys:
            point = points.get(key)
            if point is not None and point.source is text:
                del points[key]

    def find(self, text: str) -> Reuse | None:
        """What `text` can take from the cached text it shares most with, else None."""
        points = self._points
        key = prefix_keys(text)
        best = None
        lo, hi = 0, len(text) // STRIDE
        while lo < hi:
            mid = (lo + hi + 1) // 2
            point = points.get((mid * STRIDE, key(mid * STRIDE)))
            if point is not None:
                best, lo = point, mid
            else:
                hi = mid - 1
        if best is None or not best.source.startswith(text[: best.end]):  # none, or a collision
            return None
        shared = shared_length(text, best.source, best.end)
        cut = safe_cut(text, shared - 1, best.cut)
        if cut == 0:
            return None
        if self._added is not None and not (
            self._clear(text, cut, shared) and self._clear(best.source, cut, shared)
        ):
            return None
        return Reuse(best, cut, bisect_left(best.starts, cut), shared)

    def _clear(self, text: str, cut: int, shared: int) -> bool:
        """No added (non-special) token occurs from just before the cut to just past the shared
        text, where one could span the cut (in either text: they differ past `shared`)."""
        assert self._added is not None
        reach = self._reach
        return self._added.search(text, max(cut - reach, 0), shared + reach) is None

"""Reusing a cached text prefix's ids inside one segment gives exactly the whole text's ids, or stays off.

The property: a long piece C is cached; a new piece that shares any number of C's leading
characters and then goes on with any text tokenizes, through the reuse path, to
`Tokenizer.encode(add_special_tokens=False)` of the whole — for the tiny model's GPT-2-style
byte-level tokenizer and for the Llama 3 and Qwen 2 split patterns on the same vocabulary.
"""

from __future__ import annotations

import json
import logging
from array import array
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers

from dynamo_graph.llm.prefix_reuse import STRIDE, PrefixIndex, prefix_keys, reuse_refusal, shared_length
from dynamo_graph.llm.segment_tokenizer import SegmentTokenizer, entry_bytes

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL = "<|eot_id|>"
# Characters where pre-tokenizers differ (whitespace kinds, digits, contractions, combining
# marks, punctuation, scripts without spaces), and any character now and then.
TRICKY = st.sampled_from(list(" \n\t\r \u3000abcXYZé'sd0123456789.,!?-_()\u0301日本語🙂")) | st.characters(
    codec="utf-8", exclude_categories=("Cs",)
)
TEXT = st.text(TRICKY, max_size=300)


@pytest.fixture(scope="module")
def tiny(tiny_model: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def _with_split(tiny_model: Path, pattern: str, nfc: bool) -> Tokenizer:
    """The tiny model's vocabulary behind a `Split` regex then a regex-less ByteLevel, as Llama 3
    and Qwen 2 pre-tokenize (Qwen 2 also normalizes to NFC)."""
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    if nfc:
        tok.normalizer = normalizers.NFC()
    return tok


@pytest.fixture(scope="module")
def tokenizers_(tiny: Tokenizer, tiny_model: Path) -> dict[str, Tokenizer]:
    return {
        "gpt2-bytelevel": tiny,
        "llama3-split": _with_split(tiny_model, LLAMA3_SPLIT, nfc=False),
        "qwen2-split-nfc": _with_split(tiny_model, QWEN2_SPLIT, nfc=True),
    }


def whole(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(["gpt2-bytelevel", "llama3-split", "qwen2-split-nfc"]),
    parts=st.lists(TEXT, min_size=1, max_size=8),
    tail=TEXT,
    data=st.data(),
)
def test_a_cached_prefix_continued_by_any_text_tokenizes_as_a_whole(
    tokenizers_: dict[str, Tokenizer], name: str, parts: list[str], tail: str, data
) -> None:
    cached = " ".join(parts)
    while len(cached) < 2 * STRIDE:
        cached += " " + cached + "x"
    check_continuation(tokenizers_[name], cached, data.draw(st.integers(STRIDE, len(cached))), tail)


@pytest.mark.parametrize(
    ("name", "cached", "shared", "tail"),
    [
        # "a\n  " pre-tokenizes (Llama 3) as "a", "\n", "  ", but "a\n  \n" as "a", "\n  \n":
        # a cut before the shared text's last pre-token would be wrong here.
        ("llama3-split", "word " * 60 + "a\n  " + "b" * 130, 300 + 4, "\n"),
        # Inside a run of spaces only the last one starts a pre-token: no cut may be taken there.
        ("gpt2-bytelevel", "word " * 40 + "a" + " " * 300, 400, "b"),
        ("llama3-split", "word " * 40 + "1234567" * 40, 390, "89"),
    ],
)
def test_known_traps(
    tokenizers_: dict[str, Tokenizer], name: str, cached: str, shared: int, tail: str
) -> None:
    check_continuation(tokenizers_[name], cached, shared, tail)


def check_continuation(tokenizer: Tokenizer, cached: str, shared: int, tail: str) -> None:
    """`cached` in the cache, then its first `shared` characters and `tail`: the whole's ids."""
    segments = SegmentTokenizer(tokenizer)
    assert segments.reuses_prefixes
    segments.encode(SPECIAL + cached + SPECIAL)
    text = SPECIAL + cached[:shared] + tail + SPECIAL
    assert segments.encode(text) == whole(tokenizer, text)


def test_a_document_then_questions_in_one_message_reuse_the_documents_ids(tiny: Tokenizer) -> None:
    """The issue's shape: each request tokenizes the last word of the document and its question,
    and names the same prefix (a token count and key) for the router's block hashes."""
    segments = SegmentTokenizer(tiny)
    document = "Answer from this document.\n\n" + "serving router prefix cache token model " * 300
    named = []
    for number in range(4):
        text = f"<|start_header_id|>user<|end_header_id|>\n\n{document}\n\nRequest {number}: why?{SPECIAL}"
        ids, prefixes = segments.encode_prefixed(text)
        assert ids == whole(tiny, text)
        named.append(prefixes[-1])
    assert (segments.misses, segments.prefix_hits) == (1, 3)
    assert named[1] == named[2] == named[3]
    count = named[1][0]
    document_ids = len(whole(tiny, f"<|start_header_id|>user<|end_header_id|>\n\n{document}"))
    assert document_ids - STRIDE < count <= document_ids  # all but the last stride's tokens


class _Recording:
    """The tokenizer, with the texts it was asked to encode."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.texts: list[str] = []

    def encode(self, text: str, **kwargs):
        self.texts.append(text)
        return self.tokenizer.encode(text, **kwargs)


def test_a_reuse_tokenizes_from_the_word_the_texts_part_in_and_caches_no_copy(tiny: Tokenizer) -> None:
    """Past the checkpoint, the texts are compared: only the word in which they part, and what
    follows, is tokenized again; a question shorter than a stride adds nothing to the cache."""
    segments = SegmentTokenizer(tiny)
    document = "Answer from this document.\n\n" + ("serving router prefix cache token model " * 300).rstrip()
    segments.encode(f"{SPECIAL}{document}\n\nRequest 0: why?{SPECIAL}")
    held = (len(segments), segments.held_bytes, len(segments._prefixes))
    recording = segments.tokenizer = _Recording(tiny)  # type: ignore[assignment]
    for number in (1, 22, 333):
        text = f"{SPECIAL}{document}\n\nRequest {number}: why?{SPECIAL}"
        assert segments.encode(text) == whole(tiny, text)
        assert recording.texts[-1] == f" model\n\nRequest {number}: why?"
    assert (len(segments), segments.held_bytes, len(segments._prefixes)) == held


@settings(max_examples=200, deadline=None)
@given(
    head=st.text("ab .'\n", min_size=STRIDE, max_size=3 * STRIDE),
    rest=st.text(TRICKY, min_size=STRIDE // 2, max_size=2 * STRIDE),
    data=st.data(),
)
def test_checkpoint_keys_of_a_cached_text_are_those_a_lookup_computes(head: str, rest: str, data) -> None:
    """`add` streams the keys of a text's ASCII head and hashes slices past it; `find` hashes
    each probe's prefix alone: the keys agree, for any text and any start of the stream, and a
    prefix's key is the same in every text that starts with it."""
    text = head + rest
    index = PrefixIndex([])
    first = data.draw(st.sampled_from(range(0, len(text) // STRIDE * STRIDE + 1, STRIDE)))
    keys = index.add(text, array("I", range(len(text))), first)
    assert [x for x, _ in keys] == list(range(first + STRIDE, len(text) + 1, STRIDE))
    key = prefix_keys(text)
    assert all(digest == key(x) for x, digest in keys)
    other = prefix_keys(text + data.draw(st.text(TRICKY, max_size=4)))
    assert all(key(x) == other(x) == prefix_keys(text[:x])(x) for x, _ in keys)


@given(a=st.text("ab", max_size=40), b=st.text("ab", max_size=40))
def test_shared_length_is_the_common_prefix(a: str, b: str) -> None:
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    assert shared_length(a, b) == common
    assert shared_length(a, b, common // 2) == common


def test_the_cache_with_checkpoints_stays_within_its_budget(tiny: Tokenizer) -> None:
    documents = [f"document {i}: " + "words and more words " * 60 for i in range(12)]
    budget = 3 * entry_bytes(documents[0], len(whole(tiny, documents[0]))) * 2
    segments = SegmentTokenizer(tiny, max_bytes=budget)
    for document in documents:
        for question in ("Why?", "How?"):
            text = SPECIAL + document + question + SPECIAL
            assert segments.encode(text) == whole(tiny, text)
            assert 0 < segments.held_bytes <= budget
    # Only the cached texts' checkpoints are left: an evicted one's went with it.
    assert 0 < len(segments._prefixes) <= len(segments) * (len(documents[0]) // STRIDE + 1)
    assert segments.prefix_hits == len(documents)


def test_a_text_found_by_its_prefix_may_push_that_prefix_out_of_a_small_cache(tiny: Tokenizer) -> None:
    """The cache holds one document: the longer text found by its prefix replaces it."""
    document = "words and more words " * 30
    budget = 2 * entry_bytes(document, len(whole(tiny, document)))
    segments = SegmentTokenizer(tiny, max_bytes=budget)
    segments.encode(SPECIAL + document + SPECIAL)
    longer = SPECIAL + document + "and then a good deal more text " * 12 + SPECIAL
    ids, prefixes = segments.encode_prefixed(longer)
    assert ids == whole(tiny, longer) and segments.prefix_hits == 1
    assert len(segments) == 1 and segments.held_bytes <= budget
    assert prefixes[-1][0] < len(whole(tiny, SPECIAL + document))  # named at the cut


def _pairs_of_words(tiny_model: Path) -> Tokenizer:
    """A split pattern that keeps two words and the space between them together, and a merge
    of a word's last letter with the space after it (first in rank): a space after a word is
    then not a safe cut, and the load-time probe must find out."""
    spec = json.loads(_with_split(tiny_model, r"\w+ \w+|\s+|\w+|[^\s\w]+", nfc=False).to_str())
    vocab = spec["model"]["vocab"]
    vocab["eĠ"] = max(vocab.values()) + 1
    spec["model"]["merges"].insert(0, ["e", "Ġ"])
    return Tokenizer.from_str(json.dumps(spec))


def test_the_load_time_probe_turns_reuse_off_where_a_cut_would_change_the_ids(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokenizer = _pairs_of_words(tiny_model)
    assert reuse_refusal(tokenizer) is None  # its shape is allowed: only the probe can tell
    with caplog.at_level(logging.INFO, logger="dynamo_graph.llm.segment_tokenizer"):
        segments = SegmentTokenizer(tokenizer)
    assert segments.enabled and not segments.reuses_prefixes
    assert "no pre-token starts at the space" in caplog.text
    text = SPECIAL + "alpha beta gamma delta " * 30 + SPECIAL
    segments.encode(text)
    other = text[: 3 * STRIDE] + " epsilon" + SPECIAL
    assert segments.encode(other) == whole(tokenizer, other)


def test_tokenizers_of_other_shapes_are_refused_with_a_reason(tiny_model: Path) -> None:
    def variant(**parts) -> Tokenizer:
        tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
        for attribute, value in parts.items():
            setattr(tok, attribute, value)
        return tok

    assert "normalizer NFKC" in reuse_refusal(variant(normalizer=normalizers.NFKC()))
    assert "prefix space" in reuse_refusal(
        variant(pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=True))
    )
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    assert "Metaspace" in reuse_refusal(variant(pre_tokenizer=metaspace))
    no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    assert "no regex" in reuse_refusal(variant(pre_tokenizer=no_regex))
    spec = json.loads(variant().to_str())
    spec["model"]["dropout"] = 0.1
    assert "dropout" in reuse_refusal(Tokenizer.from_str(json.dumps(spec)))


def test_reuse_can_be_turned_off(tiny: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_TOKENIZE_PREFIX_REUSE", "0")
    segments = SegmentTokenizer(tiny)
    assert segments.enabled and not segments.reuses_prefixes

"""Incremental detokenization equals tokenizer.decode of the whole stream, however it is split."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer

from dynamo_graph.dev.tiny_tokenizer import EOT_ID
from dynamo_graph.llm.detokenizer import DetokenizerFactory, IncrementalDetokenizer

ADVERSARIAL = [
    "plain ascii text, with punctuation!",
    "emoji 😀🎉 and 4-byte 𝄞 music",
    "family 👩‍👩‍👧 and 👨🏽‍💻 (ZWJ + skin tone)",
    "flags 🇫🇷🇯🇵🏴‍☠️ side by side",
    "中文字符和日本語のテキスト、한국어",
    "combining: e\u0301 a\u0308 n\u0303 Z\u0351\u0325\u0317",
    "mixed: héllo wörld — “quotes” … 😀中e\u0301",
    "  leading spaces and\ttabs\nnewlines\n\n",
]


def _decode_stream(factory: DetokenizerFactory, chunks: list[list[int]], skip: bool) -> str:
    detok = factory.new(skip_special_tokens=skip)
    return "".join(detok.add(chunk) for chunk in chunks) + detok.flush()


def _random_chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        step = rng.randint(1, 4)
        chunks.append(ids[i : i + step])
        i += step
    return chunks


@pytest.fixture(params=["byte_level", "sentencepiece"])
def tok_and_factory(request: pytest.FixtureRequest) -> tuple[Tokenizer, DetokenizerFactory]:
    if request.param == "byte_level":
        return request.getfixturevalue("tokenizer"), request.getfixturevalue("detok_factory")
    return request.getfixturevalue("sp_tokenizer"), request.getfixturevalue("sp_factory")


def test_strategy_detection(detok_factory: DetokenizerFactory, sp_factory: DetokenizerFactory) -> None:
    assert detok_factory.byte_level
    assert not sp_factory.byte_level


@pytest.mark.parametrize("text", ADVERSARIAL)
@pytest.mark.parametrize("skip", [False, True])
def test_one_token_at_a_time(
    tok_and_factory: tuple[Tokenizer, DetokenizerFactory], text: str, skip: bool
) -> None:
    tok, factory = tok_and_factory
    ids = tok.encode(text, add_special_tokens=False).ids
    assert _decode_stream(factory, [[i] for i in ids], skip) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_random_chunk_splits(tok_and_factory: tuple[Tokenizer, DetokenizerFactory], text: str) -> None:
    tok, factory = tok_and_factory
    ids = tok.encode(text, add_special_tokens=False).ids
    expected = tok.decode(ids, skip_special_tokens=False)
    rng = random.Random(1234)
    for _ in range(30):
        assert _decode_stream(factory, _random_chunks(ids, rng), False) == expected


def test_never_emits_replacement_for_split_character(
    detok_factory: DetokenizerFactory, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode("👩‍👩‍👧中文e\u0301", add_special_tokens=False).ids
    detok = detok_factory.new(skip_special_tokens=False)
    pieces = [detok.add([i]) for i in ids]
    assert "\ufffd" not in "".join(pieces)
    assert "" in pieces  # some tokens were partial characters and were held
    assert "👩" in pieces  # ... and each character came out whole


def test_random_token_ids_match_decode(detok_factory: DetokenizerFactory, tokenizer: Tokenizer) -> None:
    """Arbitrary id sequences (invalid UTF-8, specials, truncated characters) decode like decode()."""
    rng = random.Random(99)
    vocab = tokenizer.get_vocab_size()
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        for skip in (False, True):
            expected = tokenizer.decode(ids, skip_special_tokens=skip)
            assert _decode_stream(detok_factory, [[i] for i in ids], skip) == expected
            assert _decode_stream(detok_factory, _random_chunks(ids, rng), skip) == expected


@pytest.mark.parametrize("skip", [False, True])
def test_special_tokens_shown_or_skipped(
    detok_factory: DetokenizerFactory, tokenizer: Tokenizer, skip: bool
) -> None:
    ids = [*tokenizer.encode("Hi there", add_special_tokens=False).ids, EOT_ID]
    ids += tokenizer.encode(" after", add_special_tokens=False).ids
    out = _decode_stream(detok_factory, [[i] for i in ids], skip)
    assert out == ("Hi there after" if skip else "Hi there<|eot_id|> after")


def test_truncated_character_at_end_flushes_replacement(
    detok_factory: DetokenizerFactory, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode("ok 😀", add_special_tokens=False).ids[:-1]
    detok = detok_factory.new(skip_special_tokens=False)
    streamed = "".join(detok.add([i]) for i in ids)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tokenizer.decode(ids, skip_special_tokens=False)
    assert detok.flush() == ""


def test_special_token_inside_split_character(
    detok_factory: DetokenizerFactory, tokenizer: Tokenizer
) -> None:
    emoji = tokenizer.encode("😀", add_special_tokens=False).ids
    ids = [*emoji[:2], EOT_ID, *emoji]
    assert _decode_stream(detok_factory, [[i] for i in ids], False) == tokenizer.decode(
        ids, skip_special_tokens=False
    )


def test_unknown_ids_are_ignored_like_decode(detok_factory: DetokenizerFactory, tokenizer: Tokenizer) -> None:
    ids = [*tokenizer.encode("a b", add_special_tokens=False).ids, 10**6, 70]
    assert _decode_stream(detok_factory, [[i] for i in ids], False) == tokenizer.decode(
        ids, skip_special_tokens=False
    )


def test_added_tokens_with_unmapped_characters(tokenizer: Tokenizer) -> None:
    """Added tokens whose content is not byte-level encoded (spaces, Latin-1) decode like decode()."""
    tok = Tokenizer.from_str(tokenizer.to_str())
    tok.add_tokens([AddedToken("héllo wörld", special=False), AddedToken("héllo", special=False)])
    tok.add_special_tokens([AddedToken("<tool call>", special=True)])
    factory = DetokenizerFactory(tok)
    ids = tok.encode("a héllo wörld b <tool call> héllo c", add_special_tokens=False).ids
    assert len(ids) < len(
        tokenizer.encode("a héllo wörld b <tool call> héllo c", add_special_tokens=False).ids
    )
    for skip in (False, True):
        assert _decode_stream(factory, [[i] for i in ids], skip) == tok.decode(ids, skip_special_tokens=skip)


def test_accepts_bare_tokenizer(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("中文 ok", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    assert "".join(detok.add([i]) for i in ids) + detok.flush() == "中文 ok"


def test_window_strategy_keeps_leading_space_after_prompt(
    sp_factory: DetokenizerFactory, sp_tokenizer: Tokenizer
) -> None:
    """With prompt context, the first output token's leading space survives (no Strip at start)."""
    prompt = sp_tokenizer.encode("Say", add_special_tokens=False).ids
    output = sp_tokenizer.encode("Say hello 中文", add_special_tokens=False).ids[len(prompt) :]
    detok = sp_factory.new(skip_special_tokens=False, prompt_ids=prompt)
    assert "".join(detok.add([i]) for i in output) + detok.flush() == " hello 中文"


def test_window_strategy_truncated_character_flushes(
    sp_factory: DetokenizerFactory, sp_tokenizer: Tokenizer
) -> None:
    ids = sp_tokenizer.encode("ab 😀", add_special_tokens=False).ids[:-1]
    detok = sp_factory.new(skip_special_tokens=False)
    streamed = "".join(detok.add([i]) for i in ids)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == sp_tokenizer.decode(ids, skip_special_tokens=False)

"""Segment-cached tokenization gives exactly the whole prompt's ids, or stays off.

The property: for any conversation rendered by the model's real chat template, and for any text
cut at random points with special tokens put in the cuts, `SegmentTokenizer.encode` equals
`Tokenizer.encode(add_special_tokens=False)` — on a cold cache, and again on a warm one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from dynamo_graph.llm.chat_template import ChatTemplate
from dynamo_graph.llm.model_source import resolve_model
from dynamo_graph.llm.segment_tokenizer import MIN_CACHED_CHARS, SegmentTokenizer

ALPHABET = st.characters(codec="utf-8", exclude_categories=("Cs",))
TEXT = st.text(ALPHABET, max_size=400) | st.sampled_from(["", " ", "\n\n", "hello world", " x" * 200])


@pytest.fixture(scope="module")
def model(tiny_model: Path):
    return resolve_model(str(tiny_model))


@pytest.fixture(scope="module")
def tokenizer(model) -> Tokenizer:
    return model.load_tokenizer()


def whole(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    messages=st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant"]), TEXT), min_size=1, max_size=6
    )
)
def test_rendered_conversations_tokenize_identically(model, tokenizer: Tokenizer, messages) -> None:
    template = ChatTemplate(model.chat_template, bos_token=model.bos_token, eos_token=model.eos_token)
    prompt = template.render([{"role": r, "content": c} for r, c in messages], add_generation_prompt=True)
    segments = SegmentTokenizer(tokenizer)
    assert segments.enabled
    expected = whole(tokenizer, prompt)
    assert segments.encode(prompt) == expected  # cold
    assert segments.encode(prompt) == expected  # warm: long segments come from the cache


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(ALPHABET, min_size=1, max_size=2000), data=st.data())
def test_any_text_cut_anywhere_by_special_tokens(tokenizer: Tokenizer, text: str, data) -> None:
    specials = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces, last = [], 0
    for cut in cuts:
        pieces += [text[last:cut], data.draw(st.sampled_from(specials))]
        last = cut
    joined = "".join([*pieces, text[last:]])
    segments = SegmentTokenizer(tokenizer)
    assert segments.encode(joined) == whole(tokenizer, joined)
    assert segments.encode(joined) == whole(tokenizer, joined)


def test_a_repeated_prefix_is_served_from_the_cache(tokenizer: Tokenizer) -> None:
    segments = SegmentTokenizer(tokenizer)
    document = "A shared document about serving language models. " * 40
    for turn in range(3):
        prompt = f"<|start_header_id|>system<|end_header_id|>\n\n{document}<|eot_id|>question {turn}"
        assert segments.encode(prompt) == whole(tokenizer, prompt)
    assert (segments.misses, segments.hits) == (1, 2)


def test_the_cache_stays_within_its_budget(tokenizer: Tokenizer) -> None:
    segments = SegmentTokenizer(tokenizer, max_bytes=3 * (MIN_CACHED_CHARS + 4 * MIN_CACHED_CHARS))
    for i in range(20):
        text = f"{i} " + "x" * MIN_CACHED_CHARS
        assert segments.encode(text + "<|eot_id|>") == whole(tokenizer, text + "<|eot_id|>")
    assert 0 < segments.held_bytes <= segments.max_bytes


def _sentencepiece_like(prepend_first: bool) -> Tokenizer:
    """A Metaspace tokenizer (as Llama 2's): with prepend_scheme "first" only the input's first
    piece gets the ▁ prefix, so pieces between special tokens do not tokenize independently."""
    vocab = {"<unk>": 0, "▁": 1, "▁a": 2, "a": 3, "▁b": 4, "b": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([])
    scheme = "first" if prepend_first else "always"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=True)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme, split=True)
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


def test_a_tokenizer_whose_first_piece_differs_turns_the_cache_off() -> None:
    first_only = SegmentTokenizer(_sentencepiece_like(prepend_first=True))
    assert not first_only.enabled
    text = "a b</s>a b" * 50
    assert first_only.encode(text) == whole(first_only.tokenizer, text)
    assert SegmentTokenizer(_sentencepiece_like(prepend_first=False)).enabled

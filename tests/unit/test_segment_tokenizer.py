"""Segment-cached tokenization gives exactly the whole prompt's ids, or stays off.

The property: for any conversation rendered by the model's real chat template, and for any text
cut at random points with special tokens put in the cuts, `SegmentTokenizer.encode` equals
`Tokenizer.encode(add_special_tokens=False)` — on a cold cache, and again on a warm one.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from dynamo_graph.llm.chat_template import ChatTemplate
from dynamo_graph.llm.model_source import resolve_model
from dynamo_graph.llm.prefix_reuse import STRIDE
from dynamo_graph.llm.segment_tokenizer import LONG_SEGMENT_CHARS, SegmentTokenizer, entry_bytes

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
    texts = [f"{i:02d} " + "x" * LONG_SEGMENT_CHARS for i in range(20)]
    # A long piece also holds its checkpoints for prefix reuse (prefix_reuse.py).
    size = max(entry_bytes(t, len(whole(tokenizer, t)), len(t) // STRIDE) for t in texts)
    segments = SegmentTokenizer(tokenizer, max_bytes=3 * size)
    for text in texts:
        assert segments.encode(text + "<|eot_id|>") == whole(tokenizer, text + "<|eot_id|>")
        assert 0 < segments.held_bytes <= segments.max_bytes
    assert len(segments) == 3


def test_the_least_recently_used_piece_goes_first(tokenizer: Tokenizer) -> None:
    """A shared document used by every request stays while new questions push each other out."""
    document = "A shared document about serving language models. " * 40
    questions = [f"question number {i}, about the document?" for i in range(30)]
    budget = entry_bytes(document, len(whole(tokenizer, document)), len(document) // STRIDE)
    budget += 4 * max(entry_bytes(q, len(whole(tokenizer, q))) for q in questions)
    segments = SegmentTokenizer(tokenizer, max_bytes=budget)
    for question in questions:
        prompt = f"<|start_header_id|>{document}<|eot_id|>{question}"
        assert segments.encode(prompt) == whole(tokenizer, prompt)
        assert segments.held_bytes <= budget
    assert (segments.misses, segments.hits) == (1, 29)
    assert len(segments) <= 5


def test_short_pieces_come_from_the_cache_too(model, tokenizer: Tokenizer) -> None:
    """Role names, separators and earlier turns' short messages are tokenized once: a new turn
    adds only its own pieces."""
    template = ChatTemplate(model.chat_template, bos_token=model.bos_token, eos_token=model.eos_token)
    segments = SegmentTokenizer(tokenizer)
    chat = [{"role": "system", "content": "Be brief."}]
    sizes = []
    for turn in range(4):
        chat.append({"role": "user", "content": f"Question {turn}?"})
        prompt = template.render(chat, add_generation_prompt=True)
        assert segments.encode(prompt) == whole(tokenizer, prompt)
        sizes.append(len(segments))
        chat.append({"role": "assistant", "content": f"Answer {turn}."})
    # Turn 0 caches every piece; each later turn the previous answer and its own question.
    assert [b - a for a, b in itertools.pairwise(sizes)] == [2, 2, 2]


def test_prefixes_end_only_after_long_segments(model, tokenizer: Tokenizer) -> None:
    """A short question, cached or not, never ends a named prefix: the next request, with
    another question, names the same prefix."""
    template = ChatTemplate(model.chat_template, bos_token=model.bos_token, eos_token=model.eos_token)
    segments = SegmentTokenizer(tokenizer)
    document = "Answer from this document.\n\n" + "serving router prefix cache " * 100
    named = []
    for question in ("Why?", "Why?", "How?"):
        chat = [{"role": "system", "content": document}, {"role": "user", "content": question}]
        ids, prefixes = segments.encode_prefixed(template.render(chat, add_generation_prompt=True))
        named.append(prefixes)
        (count, _), *_ = prefixes
        assert len(prefixes) == 1 and ids[count] == tokenizer.token_to_id("<|eot_id|>")
    assert named[0] == named[1] == named[2]


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
